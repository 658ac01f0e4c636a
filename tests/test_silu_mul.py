"""silu_mul (SwiGLU's activation, blocked, keeping only gate and up) against the plain autograd expression."""

from __future__ import annotations

import pytest
import torch

from ringtune.models.layers import silu_mul as module
from ringtune.models.layers.silu_mul import reference_silu_mul, silu_mul


def _pair(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate, up, dy = (torch.randn(rows, cols, generator=gen, dtype=torch.float64).to(dtype) * 3 for _ in range(3))
    return gate.requires_grad_(), up.requires_grad_(), dy


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(0, 8), (1, 5), (17, 3), (700, 768), (3000, 96)])
def test_equals_the_plain_expression(dtype: torch.dtype, rows: int, cols: int, monkeypatch) -> None:
    """Bit for bit, forward and both gradients: the same ATen ops on the same elements, whole or in blocks
    (a small block size makes every shape here span several blocks, a ragged last one included; zero rows:
    an expert-parallel rank that receives no tokens)."""
    monkeypatch.setattr(module, "BLOCK_BYTES", 4096)
    gate, up, dy = _pair(rows, cols, dtype)
    got = silu_mul(gate, up)
    want = reference_silu_mul(gate, up)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for g, w in zip(torch.autograd.grad(got, (gate, up), dy), torch.autograd.grad(want, (gate, up), dy), strict=True):
        assert torch.equal(g, w)


def test_gradcheck_float64() -> None:
    gate, up, _ = _pair(6, 4, torch.float64)
    assert torch.autograd.gradcheck(silu_mul, (gate, up))


def test_keeps_two_tensors_not_three() -> None:
    """What autograd keeps until the backward: gate and up (the plain expression also keeps silu(gate))."""

    def saved_bytes(fn) -> int:
        kept: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t)
            return t

        gate, up, _ = _pair(64, 32, torch.float32)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(gate, up)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
        return sum(storages.values())

    one = 64 * 32 * 4
    assert saved_bytes(silu_mul) == 2 * one
    assert saved_bytes(reference_silu_mul) == 3 * one


def test_views_dtypes_and_no_grad() -> None:
    """MoE passes the two halves of one gate_up product (strided views); two dtypes promote like the plain
    expression; under no_grad nothing is kept and the value is the same; shapes must match."""
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(9, 2 * 7, generator=gen, dtype=torch.float64, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    dy = torch.randn(9, 7, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(silu_mul(gate, up), gate_up, dy)[0]
    want = torch.autograd.grad(reference_silu_mul(gate, up), gate_up, dy)[0]
    assert torch.equal(got, want)
    low = up.detach().to(torch.bfloat16)
    assert torch.equal(silu_mul(gate.detach(), low), reference_silu_mul(gate.detach(), low))
    with torch.no_grad():
        out = silu_mul(gate, up)
    assert out.grad_fn is None and torch.equal(out, reference_silu_mul(gate, up).detach())
    with pytest.raises(ValueError, match=r"one shape; got \(9, 7\) and \(9, 1\)"):
        silu_mul(gate, up[:, :1])
