"""The log-prob head's one-pass gradients (``upstream`` known at forward time) against its two-pass path and
the plain reference, the fallback when the backward's gradient differs, which losses qualify, and the Trainer
using it for cross_entropy."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import hf_model

from ringtune.engine import microbatch as microbatch_module
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.losses import FIXED_GRADIENT_LOSSES, LOSS_FNS, fixed_logprob_gradient, local_token_losses
from ringtune.losses.config import parse_loss_config
from ringtune.models import logprob_head
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.logprob_head import label_logprobs, plan_tiles, reference_label_logprobs, takes_one_pass

T, D, V = 29, 16, 53
IGNORE = -100


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tiles (conftest.one_thread)


def case(k: int | None, bias: bool, seed: int = 0):
    """hidden, weight, bias (leaves), labels [T] or [T, k] with ignored entries, upstream of labels' shape."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    shape = (T,) if k is None else (T, k)
    labels = torch.randint(0, V, shape, generator=gen)
    labels[[2, 7, T - 1]] = IGNORE
    if k is not None:
        labels[4, 0] = IGNORE
    upstream = torch.randn(shape, generator=gen, dtype=torch.float64)
    return hidden, weight, b, labels, upstream


def grads_of(out: torch.Tensor, leaves: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def no_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the backward recomputed the logits tiles")

    monkeypatch.setattr(logprob_head, "backward_tiles", fail)


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 4, None])
def test_one_pass_equals_two_pass_float64(monkeypatch, k: int | None, bias: bool, chunk_tokens: int | None) -> None:
    hidden, weight, b, labels, upstream = case(k, bias)
    leaves = [x for x in (hidden, weight, b) if x is not None]
    two_out = label_logprobs(hidden, weight, labels, bias=b, chunk_tokens=chunk_tokens)
    two = grads_of(two_out, leaves, upstream)
    ref_out = reference_label_logprobs(hidden, weight, labels, bias=b)
    ref = grads_of(ref_out, leaves, upstream)
    no_recompute(monkeypatch)
    one_out = label_logprobs(hidden, weight, labels, bias=b, chunk_tokens=chunk_tokens, upstream=upstream)
    one = grads_of(one_out, leaves, upstream)
    assert torch.equal(one_out, two_out)  # same forward arithmetic
    for g1, g2, gr in zip(one, two, ref, strict=True):
        assert g1.dtype == torch.float64
        torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)  # softmax as e / Σe instead of exp(l - lse)
        torch.testing.assert_close(g1, gr, rtol=0, atol=1e-10)


def test_float32_one_pass_close_to_two_pass(monkeypatch) -> None:
    # Same float32 tile arithmetic except the softmax's rounding (e / Σe vs exp(l - lse)): measured ~1e-8 here
    # on O(1) gradients; 1e-6 is ~10 float32 ulps of the largest entries.
    hidden, weight, _, labels, upstream = case(None, False)
    hidden, weight = (x.detach().float().requires_grad_() for x in (hidden, weight))
    two = grads_of(label_logprobs(hidden, weight, labels, chunk_tokens=4), [hidden, weight], upstream)
    no_recompute(monkeypatch)
    one = grads_of(
        label_logprobs(hidden, weight, labels, chunk_tokens=4, upstream=upstream), [hidden, weight], upstream
    )
    for g1, g2 in zip(one, two, strict=True):
        assert g1.dtype == torch.float32
        torch.testing.assert_close(g1, g2, rtol=0, atol=1e-6)


def test_other_gradient_falls_back_to_recompute(monkeypatch) -> None:
    """A backward gradient that differs from ``upstream`` (here 2×) is recomputed: still the reference's values."""
    hidden, weight, _, labels, upstream = case(None, False)
    calls = []
    backward_tiles = logprob_head.backward_tiles
    monkeypatch.setattr(logprob_head, "backward_tiles", lambda *a, **kw: calls.append(1) or backward_tiles(*a, **kw))
    got = grads_of(label_logprobs(hidden, weight, labels, upstream=upstream), [hidden, weight], 2 * upstream)
    want = grads_of(reference_label_logprobs(hidden, weight, labels), [hidden, weight], 2 * upstream)
    assert calls == [1]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    # Only the scored entries are compared: upstream differing at ignored ones still takes the one pass.
    calls.clear()
    out = label_logprobs(hidden, weight, labels, upstream=torch.where(labels == IGNORE, 7.0, upstream))
    grads_of(out, [hidden, weight], upstream)
    assert calls == []


def test_when_one_pass_applies() -> None:
    hidden, weight, _, labels, upstream = case(None, False)
    need = (True, True, False)
    whole = plan_tiles(hidden, weight)
    split = plan_tiles(hidden, weight, chunk_vocab=V - 1)
    assert takes_one_pass(whole, weight, upstream, need)
    assert not takes_one_pass(split, weight, upstream, need)  # a tile must hold whole rows of logits
    assert not takes_one_pass(whole, weight, None, need)
    assert not takes_one_pass(whole, weight, upstream, (False, False, False))
    with torch.no_grad():
        assert not takes_one_pass(whole, weight, upstream, need)
        out = label_logprobs(hidden, weight, labels, upstream=upstream)  # a plain forward
    torch.testing.assert_close(out, reference_label_logprobs(hidden, weight, labels).detach(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="upstream must have labels' shape"):
        label_logprobs(hidden, weight, labels, upstream=upstream[:-1])


def test_frozen_weight_and_tied_embedding(monkeypatch) -> None:
    hidden, weight, _, labels, upstream = case(None, False)
    frozen = weight.detach()
    no_recompute(monkeypatch)
    (dh,) = grads_of(label_logprobs(hidden, frozen, labels, upstream=upstream), [hidden], upstream)
    (want,) = grads_of(reference_label_logprobs(hidden, frozen, labels), [hidden], upstream)
    torch.testing.assert_close(dh, want, rtol=0, atol=1e-10)
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))
    tied = [torch.tanh(weight[ids]) for _ in range(2)]
    (got,) = grads_of(label_logprobs(tied[0], weight, labels, upstream=upstream), [weight], upstream)
    (ref,) = grads_of(reference_label_logprobs(tied[1], weight, labels), [weight], upstream)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [None, 2])
def test_fixed_gradient_is_autograds(dtype: torch.dtype, k: int | None) -> None:
    """Cast to lp's dtype, fixed_logprob_gradient is bit for bit the gradient of the loss sum; None elsewhere."""
    assert FIXED_GRADIENT_LOSSES == ("cross_entropy",)
    gen = torch.Generator().manual_seed(2)
    shape = (12,) if k is None else (12, k)
    datum_index = torch.tensor([0] * 5 + [1] * 4 + [-1] * 3)
    inputs = {
        "weights": torch.randn(shape, generator=gen, dtype=torch.float64),
        "logprobs": -torch.rand(shape, generator=gen, dtype=torch.float64),
        "advantages": torch.randn(shape, generator=gen, dtype=torch.float64),
        "sequence_ratio_mask": torch.ones(12, dtype=torch.float64),
    }
    like = torch.zeros(shape, dtype=torch.int64)
    for loss_fn in LOSS_FNS:
        config = parse_loss_config(loss_fn, None)
        fixed = fixed_logprob_gradient(config, inputs, datum_index=datum_index, like=like)
        if loss_fn not in FIXED_GRADIENT_LOSSES:
            assert fixed is None
            continue
        lp = (-torch.rand(shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
        terms = local_token_losses(config, lp, inputs, datum_index=datum_index, num_datums=2, group=None)
        (want,) = torch.autograd.grad(terms.sum().to(torch.float64), lp)
        assert torch.equal(fixed.to(dtype), want)
    pad_only = fixed_logprob_gradient(
        parse_loss_config("cross_entropy", None), {}, datum_index=datum_index[:0], like=like[:0]
    )
    assert torch.equal(pad_only, like[:0].double())


def test_trainer_cross_entropy_takes_one_pass(tmp_path, monkeypatch) -> None:
    """A float64 cross_entropy step through the Trainer (CP 1): one pass, gradients as the two-pass path."""
    hf_model("qwen3_5", seed=4).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in (9, 17, 4):
        inputs = {"target_tokens": torch.randint(0, 96, (n,), generator=gen), "weights": torch.randn(n, generator=gen)}
        data.append(TrainDatum(tokens=torch.randint(0, 96, (n,), generator=gen), inputs=inputs))

    def grads(one_pass: bool) -> tuple[dict[str, torch.Tensor], float]:
        trainer = Trainer(load_hf(tmp_path, dtype=torch.float64), None, max_tokens_per_rank=64)
        with monkeypatch.context() as m:
            if one_pass:
                no_recompute(m)
            else:
                m.setattr(microbatch_module, "fixed_logprob_gradient", lambda *a, **kw: None)
            loss = trainer.forward_backward(data, "cross_entropy").metrics["loss:sum"]
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, loss

    one, one_loss = grads(True)
    two, two_loss = grads(False)
    assert one_loss == two_loss
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=0, atol=1e-12, msg=name)
