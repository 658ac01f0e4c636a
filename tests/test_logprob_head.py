"""The tiled log-prob head against the plain log_softmax reference: values and every gradient."""

from __future__ import annotations

import pytest
import torch

from ringtune.errors import UserInputError
from ringtune.models import logprob_head
from ringtune.models.logprob_head import (
    DEFAULT_MAX_CHUNK_BYTES,
    label_logprobs,
    plan_tiles,
    reference_label_logprobs,
)

T, D, V = 23, 16, 41
IGNORE = -100


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tiles (conftest.one_thread)


def make_case(
    dtype: torch.dtype, *, tokens: int = T, bias: bool = False, ignored: tuple[int, ...] = (2, 3, 11), seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """hidden [tokens, D], weight [V, D], bias [V] or None (all leaves needing grad), labels, grad_out [tokens]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()) if bias else None
    labels = torch.randint(0, V, (tokens,), generator=gen)
    labels[[i for i in ignored if i < tokens]] = IGNORE
    grad_out = torch.randn(tokens, generator=gen, dtype=torch.float64)
    return hidden, weight, b, labels, grad_out


def values_and_grads(fn, hidden, weight, bias, labels, grad_out, **kw) -> list[torch.Tensor]:
    """[logprobs, d_hidden, d_weight(, d_bias)] of ``fn`` for the upstream gradient ``grad_out``."""
    out = fn(hidden, weight, labels, bias=bias, **kw)
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    return [out.detach(), *grads]


@pytest.mark.parametrize(
    ("chunk_tokens", "chunk_vocab"),
    [(1, None), (4, None), (T, None), (T + 9, None), (5, 7), (T + 9, 1), (1, V), (None, None)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_float64_matches_reference(chunk_tokens: int | None, chunk_vocab: int | None, bias: bool) -> None:
    hidden, weight, b, labels, grad_out = make_case(torch.float64, bias=bias)
    want = values_and_grads(reference_label_logprobs, hidden, weight, b, labels, grad_out)
    got = values_and_grads(
        label_logprobs, hidden, weight, b, labels, grad_out, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab
    )
    for name, g, w in zip(["logprobs", "d_hidden", "d_weight", "d_bias"], got, want, strict=False):
        assert g.dtype == torch.float64, name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_budget_tiles_match_reference() -> None:
    """A budget of 21 float64 logits picks 1-token tiles of 21 columns (vocab split in 2); values as the reference."""
    hidden, weight, b, labels, grad_out = make_case(torch.float64, bias=True)
    want = values_and_grads(reference_label_logprobs, hidden, weight, b, labels, grad_out)
    assert plan_tiles(hidden, weight, max_chunk_bytes=21 * 8).vocab == 21
    got = values_and_grads(label_logprobs, hidden, weight, b, labels, grad_out, max_chunk_bytes=21 * 8)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_ignored_tokens_are_zero_and_get_no_gradient() -> None:
    hidden, weight, _, labels, grad_out = make_case(torch.float64, ignored=(0, 5, T - 1))
    out, d_hidden, _ = values_and_grads(label_logprobs, hidden, weight, None, labels, grad_out, chunk_tokens=4)
    ignored = labels == IGNORE
    assert torch.equal(out[ignored], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(d_hidden[ignored], torch.zeros(3, D, dtype=torch.float64))
    assert (out[~ignored] < 0).all()
    assert (d_hidden[~ignored].abs().sum(dim=1) > 0).all()


def test_custom_ignore_index_and_all_ignored() -> None:
    hidden, weight, _, labels, grad_out = make_case(torch.float64, ignored=())
    want = values_and_grads(reference_label_logprobs, hidden, weight, None, labels, grad_out, ignore_index=7)
    got = values_and_grads(label_logprobs, hidden, weight, None, labels, grad_out, ignore_index=7, chunk_tokens=5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    none_scored = torch.full((T,), IGNORE)
    out, d_hidden, d_weight = values_and_grads(label_logprobs, hidden, weight, None, none_scored, grad_out)
    assert torch.equal(out, torch.zeros(T, dtype=torch.float64))
    assert not d_hidden.any() and not d_weight.any()


def test_zero_tokens() -> None:
    hidden, weight, b, labels, grad_out = make_case(torch.float64, tokens=0, bias=True)
    out, d_hidden, d_weight, d_bias = values_and_grads(label_logprobs, hidden, weight, b, labels, grad_out)
    assert out.shape == (0,) and d_hidden.shape == (0, D)
    assert d_weight.shape == (V, D) and not d_weight.any() and not d_bias.any()


def test_masked_vocab_block() -> None:
    """A vocab block whose bias is all -inf (padded vocabulary) adds nothing, as in log_softmax."""
    hidden, weight, b, labels, grad_out = make_case(torch.float64, bias=True)
    with torch.no_grad():
        b[V - 8 :] = float("-inf")
    labels = torch.where(labels >= V - 8, 0, labels)
    want = values_and_grads(reference_label_logprobs, hidden, weight, b, labels, grad_out)
    got = values_and_grads(label_logprobs, hidden, weight, b, labels, grad_out, chunk_tokens=6, chunk_vocab=8)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_tied_embedding_gradient_accumulates() -> None:
    """weight is also the embedding that produced hidden: both uses add into one gradient."""
    gen = torch.Generator().manual_seed(3)
    embedding = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    mix = torch.randn(D, D, generator=gen, dtype=torch.float64) / D**0.5
    ids = torch.randint(0, V, (T,), generator=gen)
    labels = torch.roll(ids, -1)
    labels[-1] = IGNORE
    grad_out = torch.randn(T, generator=gen, dtype=torch.float64)

    def tied_grad(fn, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(embedding[ids] @ mix)
        out = fn(hidden, embedding, labels, **kw)
        (grad,) = torch.autograd.grad(out, embedding, grad_out)
        return out.detach(), grad

    want_out, want_grad = tied_grad(reference_label_logprobs)
    got_out, got_grad = tied_grad(label_logprobs, chunk_tokens=4, chunk_vocab=9)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-10)
    # Both paths contribute: the head alone (hidden detached) gives a different gradient.
    frozen_hidden = torch.tanh(embedding[ids] @ mix).detach()
    (head_only,) = torch.autograd.grad(label_logprobs(frozen_hidden, embedding, labels), embedding, grad_out)
    assert (head_only - got_grad).abs().max() > 1e-3


def test_frozen_weight_gives_only_hidden_gradient() -> None:
    hidden, weight, _, labels, grad_out = make_case(torch.float64)
    weight = weight.detach()
    out = label_logprobs(hidden, weight, labels, chunk_tokens=5)
    (got,) = torch.autograd.grad(out, hidden, grad_out)
    (want,) = torch.autograd.grad(reference_label_logprobs(hidden, weight, labels), hidden, grad_out)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("one_pass", [False, True])
def test_logits_spread_past_subnormal_exp(one_pass: bool) -> None:
    """Logits of every token spread over more than 100 nats (~300-550): exp(l - max) of most columns would be
    subnormal or 0 in float32 (below -87.3) and the head floors its argument at log(tiny) + 1 (a subnormal result
    is slow on x86). The floored terms add < V · 3e-38 to a sum >= 1, so the values and gradients still equal the
    float64 reference: float64 to 1e-10; float32 within 1e-3, its own rounding at this scale (logits of size ~500
    carry ~1e-4 of float32 error, which the softmax turns into ~1e-4 relative in gradients of size ~3: measured
    3.3e-4)."""
    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, 1e-3)):
        hidden, weight, b, labels, grad_out = make_case(dtype, bias=True, seed=3)
        with torch.no_grad():
            weight.mul_(100.0)  # logits of std ~100 across the 41-word vocabulary
        up = {"upstream": grad_out.to(dtype)} if one_pass else {}
        got = values_and_grads(label_logprobs, hidden, weight, b, labels, grad_out, chunk_tokens=4, **up)
        leaves64 = [x.detach().double().requires_grad_() for x in (hidden, weight, b)]
        want = values_and_grads(reference_label_logprobs, *leaves64, labels, grad_out)
        spread = (hidden.double() @ weight.double().T).detach().aminmax(dim=1)
        assert float((spread.max - spread.min).min()) > 100  # many columns far past the subnormal range
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=atol)


def test_float32_against_float64() -> None:
    # float32 rounding (eps 1.2e-7) of D=16-term logits of O(1) size, a 41-term log-sum-exp and the gradient
    # sums: measured <= 6e-7 against float64 here; 5e-6 leaves ~10x headroom and is still far below 1e-3.
    hidden, weight, b, labels, grad_out = make_case(torch.float32, bias=True)
    got = values_and_grads(label_logprobs, hidden, weight, b, labels, grad_out, chunk_tokens=4, chunk_vocab=9)
    leaves64 = [x.detach().double().requires_grad_() for x in (hidden, weight, b)]
    want = values_and_grads(reference_label_logprobs, *leaves64, labels, grad_out)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=0, atol=5e-6)


def test_bfloat16_computes_in_float32() -> None:
    hidden, weight, _, labels, grad_out = make_case(torch.bfloat16)
    out, d_hidden, d_weight = values_and_grads(
        label_logprobs, hidden, weight, None, labels, grad_out, chunk_tokens=4, chunk_vocab=9
    )
    assert out.dtype == torch.float32 and d_hidden.dtype == d_weight.dtype == torch.bfloat16
    leaves64 = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    want_out, want_dh, want_dw = values_and_grads(reference_label_logprobs, *leaves64, None, labels, grad_out)
    # The log-probs are float32 math on the same (bf16-rounded) inputs, against float64 math on them: measured
    # ~6e-7. A bf16 logits tensor (what a plain bf16 head gives) is off by ~3e-3 here, so 5e-6 shows the
    # logits really are float32.
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=5e-6)
    # The gradients are accumulated in float32 and rounded once to bf16 (8 significant bits): round-to-nearest
    # is within 2^-8 relative (measured 3.8e-3 = 0.96 · 2^-8), plus float32 noise (~1e-6) that atol covers.
    torch.testing.assert_close(d_hidden.double(), want_dh, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(d_weight.double(), want_dw, rtol=2**-8, atol=1e-5)


def test_bad_label_raises_before_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, weight, _, labels, _ = make_case(torch.float64)

    def no_compute(*args: object, **kwargs: object) -> None:
        raise AssertionError("tiles were computed before the labels were checked")

    monkeypatch.setattr(logprob_head, "forward_tiles", no_compute)
    for bad in (V, V + 5, -1):
        wrong = labels.clone()
        wrong[4] = bad
        for fn in (label_logprobs, reference_label_logprobs):
            with pytest.raises(UserInputError, match=rf"labels holds {bad}\b.*V = {V}"):
                fn(hidden, weight, wrong)
    assert issubclass(UserInputError, ValueError)
    with pytest.raises(ValueError, match="chunk_tokens"):
        label_logprobs(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels must be \\[T\\]"):
        label_logprobs(hidden, weight, labels[:-1])


def test_saves_no_logits() -> None:
    """Only inputs, indices and per-token log-sum-exps are kept for the backward: nothing of size T × V."""
    hidden, weight, _, labels, _ = make_case(torch.float64)
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        label_logprobs(hidden, weight, labels, chunk_tokens=4)
    assert saved and max(x.numel() for x in saved) == V * D  # the weight itself
    assert all(x.numel() < T * V for x in saved)


def test_default_tile_fits_budget_at_qwen_vocab() -> None:
    """A rank of 32K tokens: the tile is the cap (tests/test_logprob_tiles.py covers smaller shards)."""
    vocab, elem = 248_320, 4
    for dtype, dim in ((torch.float32, 5120), (torch.bfloat16, 5120), (torch.float32, 64)):
        hidden = torch.empty(32768, dim, dtype=dtype, device="meta")
        weight = torch.empty(vocab, dim, dtype=dtype, device="meta")
        plan = plan_tiles(hidden, weight)
        assert plan.tokens * plan.vocab * elem <= DEFAULT_MAX_CHUNK_BYTES
        if dtype == torch.float32:  # hidden 64: 4 copies of the hidden states are below the 128-token floor
            assert plan.vocab == vocab and plan.tokens == (256 if dim == 5120 else 128)  # 270 fit, aligned to 64
        else:  # the float32 cast of a bf16 weight block stays within the budget too
            assert plan.vocab * dim * elem <= DEFAULT_MAX_CHUNK_BYTES and plan.tokens >= 1024
    small = plan_tiles(torch.empty(0, 64, device="meta"), torch.empty(vocab, 64, device="meta"), max_chunk_bytes=2**19)
    assert small.tokens == 1 and small.vocab == 2**17


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_k_labels_per_token_equal_k_single_label_passes(dtype):
    """[T, K] labels: one tile pass serves all K; values and gradients equal K separate [T] passes."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(23, 16, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(97, 16, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 97, (23, 4), generator=gen)
    labels[3] = -100  # an unscored row
    labels[5, 2] = -100  # one unscored entry in a scored row
    grad_out = torch.randn(23, 4, generator=gen, dtype=torch.float64)
    got = label_logprobs(hidden, weight, labels, chunk_tokens=5, chunk_vocab=30)
    d_hidden, d_weight = torch.autograd.grad(got, (hidden, weight), grad_out.to(got.dtype))
    want = torch.stack([reference_label_logprobs(hidden, weight, labels[:, k]) for k in range(4)], 1)
    w_hidden, w_weight = torch.autograd.grad(want, (hidden, weight), grad_out.to(want.dtype))
    tol = 1e-12 if dtype == torch.float64 else 2e-5  # float32: tile-wise log-sum-exp vs one log_softmax
    assert got.shape == (23, 4) and torch.equal(got[3], torch.zeros(4, dtype=got.dtype)) and got[5, 2] == 0
    assert torch.allclose(got, want, atol=tol, rtol=tol)
    assert torch.allclose(d_hidden, w_hidden, atol=tol, rtol=tol)
    assert torch.allclose(d_weight, w_weight, atol=tol, rtol=tol)
    assert torch.equal(reference_label_logprobs(hidden, weight, labels), want.detach().where(labels != -100, 0.0))
