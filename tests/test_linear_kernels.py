"""ringtune.ops.linear: the decoder layers' products by kernel (oneDNN for float32 on CPU, aten otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.ops.linear import LINEAR_KERNELS, Linear, linear, onednn_available, product, select_linear_kernel

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN dense linear")


def _grads(fn, x, w, b, d_y):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = fn(*leaves)
    return (y, *torch.autograd.grad(y, leaves, d_y))


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 4), (17, 8), (3, 5, 8)])
def test_onednn_float32_equals_f_linear_within_summation_order(shape):
    """Forward and every gradient against ``F.linear`` on the same float32 operands, and both against float64.

    Tolerance: the two differ only in the order of float32 sums over ``in`` (forward, d_x) or over tokens
    (d_weight, the same aten product on both); 64 random terms of size ~1 give sums ~8 whose float32 rounding is
    ~5e-7 per step: 1e-5 absolute holds both against each other and each against float64 with margin.
    """
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape[:-1], 64, generator=gen)
    w, b = torch.randn(shape[-1], 64, generator=gen), torch.randn(shape[-1], generator=gen)
    d_y = torch.randn(*shape[:-1], shape[-1], generator=gen)
    assert select_linear_kernel(x, w) == "onednn"
    got = _grads(linear, x, w, b, d_y)
    want = _grads(F.linear, x, w, b, d_y)
    exact = _grads(F.linear, x.double(), w.double(), b.double(), d_y.double())
    for g, r, e in zip(got, want, exact, strict=True):
        assert g.shape == r.shape and g.dtype == torch.float32
        assert (g - r).abs().max() < 1e-5
        assert (g.double() - e).abs().max() < 1e-5
    # negative control: the same check sees a product with the weight's rows permuted
    assert (linear(x, w.roll(1, 0)) - want[0] + b).abs().max() > 1e-2


def test_other_dtypes_take_aten_bit_for_bit():
    """float64 (the CPU oracle) and bfloat16 (mixed precision's layers) are ``F.linear`` itself."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float64, torch.bfloat16):
        x, w = torch.randn(5, 16, generator=gen).to(dtype), torch.randn(7, 16, generator=gen).to(dtype)
        assert select_linear_kernel(x, w) == "aten"
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert LINEAR_KERNELS == ("aten", "onednn")


@needs_onednn
def test_the_decoder_layers_project_through_the_registry():
    """Every projection of a Qwen3.5-shaped decoder (attention, GatedDeltaNet, MLP) is a :class:`Linear`, so the
    service's float32 CPU steps run the oneDNN kernel; the model's loss is that of ``F.linear`` within float32."""
    config = DecoderConfig.from_hf(
        {
            "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        }
    )  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(config)
    projections = [m for name, m in model.named_modules() if name.endswith("proj") or "proj_" in name]
    assert len(projections) >= 10 and all(isinstance(m, Linear) for m in projections)
    assert select_linear_kernel(torch.zeros(1, 32), projections[0].weight) == "onednn"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_product_for_hand_written_backwards(dtype):
    """:func:`product` (the log-prob head's tile logits): ``x @ weightᵀ`` by the registry's kernel, strided
    operands taken as they are; on aten it writes into ``out``, on oneDNN it returns its own tensor.

    Tolerance: float32 sums of 256 terms of size ~0.5 (the head's shape, tokens as the small operand) round by
    ~1e-6 relative to sums of ~8: 1e-4 absolute against float64; float64 is exact to 1e-12.
    """
    gen = torch.Generator().manual_seed(5)
    w_block = torch.randn(300, 256, generator=gen, dtype=torch.float64)
    h_tile = torch.randn(40, 256, generator=gen, dtype=torch.float64)
    exact = w_block @ h_tile.T
    out = torch.empty(300, 40, dtype=dtype)
    got = product(w_block.to(dtype), h_tile.to(dtype), out)
    assert got.shape == (300, 40) and got.dtype == dtype
    assert (got.double() - exact).abs().max() < (1e-4 if dtype == torch.float32 else 1e-12)
    assert (got.data_ptr() == out.data_ptr()) == (select_linear_kernel(w_block.to(dtype), h_tile.to(dtype)) == "aten")
    strided = product(w_block.to(dtype)[::2], h_tile.to(dtype).T.contiguous().T)
    assert (strided.double() - exact[::2]).abs().max() < (1e-4 if dtype == torch.float32 else 1e-12)
    # a product autograd records takes aten (oneDNN's op would give no gradient)
    leaf = h_tile.to(dtype).requires_grad_()
    product(w_block.to(dtype), leaf).sum().backward()
    assert leaf.grad is not None and (leaf.grad.double() - w_block.sum(0)).abs().max() < 1e-3
    # negative control: a token's row swapped is seen
    assert (product(w_block.to(dtype), h_tile.to(dtype).roll(1, 0)).double() - exact).abs().max() > 1e-2
