"""The log-prob head's tile shape: sized from the rank's own tokens, with a floor and a cap, and honoured by
every tile the forward and the backward compute."""

from __future__ import annotations

import pytest
import torch

from ringtune.models import logprob_head
from ringtune.models.logprob_head import label_logprobs, reference_label_logprobs
from ringtune.models.logprob_tiles import (
    DEFAULT_MAX_CHUNK_BYTES,
    MIN_TILE_TOKENS,
    TILE_HIDDEN_MULTIPLE,
    TILE_TOKEN_ALIGN,
    plan_tiles,
    tile_budget_bytes,
    tile_shape,
)


def meta_plan(tokens: int, vocab: int, dim: int, dtype: torch.dtype = torch.float32, **kw):
    hidden = torch.empty(tokens, dim, dtype=dtype, device="meta")
    return plan_tiles(hidden, torch.empty(vocab, dim, dtype=dtype, device="meta"), **kw)


def test_tile_shrinks_with_the_shard() -> None:
    """The benchmark model (V 32K, D 256, float32): a rank of T tokens gets T·4·256/32768 = T/32 tokens per tile."""
    assert TILE_HIDDEN_MULTIPLE == 4 and MIN_TILE_TOKENS == 128
    got = {t: meta_plan(t, 32768, 256) for t in (32768, 16384, 8192, 4096, 2048, 0)}
    assert {t: p.tokens for t, p in got.items()} == {32768: 1024, 16384: 512, 8192: 256, 4096: 128, 2048: 128, 0: 128}
    assert all(p.vocab == 32768 for p in got.values())
    # Under CP a rank holds T / CP tokens: above the floor its tile is 1 / CP of the CP = 1 tile.
    assert meta_plan(32768 // 4, 32768, 256).tokens * 4 == meta_plan(32768, 32768, 256).tokens


def test_tile_tokens_aligned() -> None:
    """A budget-sized tile holds a multiple of TILE_TOKEN_ALIGN tokens (rounded down: still within the budget):
    12 sequences of 682 tokens (8184) would give 255-token tiles, whose odd width halved the logits GEMM's speed
    (the regression of issue 31's packed-8K step); explicit chunk_tokens and tiles under the alignment are kept."""
    assert TILE_TOKEN_ALIGN == 64
    assert meta_plan(8184, 32768, 256).tokens == 192
    assert meta_plan(12 * 1000, 32768, 256).tokens == 320  # 375 rounded down
    for tokens in (1, 700, 8184, 9000, 40_000, 1 << 20):
        for vocab, dim in ((32768, 256), (248_320, 5120), (151_936, 2048)):
            plan = meta_plan(tokens, vocab, dim)
            assert plan.tokens % TILE_TOKEN_ALIGN == 0 or plan.tokens < TILE_TOKEN_ALIGN, (tokens, vocab, dim, plan)
    assert meta_plan(8184, 32768, 256, chunk_tokens=255).tokens == 255
    assert tile_shape(8184, 32768, 256, acc_bytes=4, weight_bytes=4, align=1).tokens == 255  # the budget's own
    assert meta_plan(1 << 16, 248_320, 64, max_chunk_bytes=2**19).tokens == 1  # the cap: under the alignment


@pytest.mark.parametrize("tokens", [0, 100, 5000, 1 << 20])
@pytest.mark.parametrize(("vocab", "dim"), [(248_320, 5120), (248_320, 64), (32768, 256), (97, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tile_within_rule(tokens: int, vocab: int, dim: int, dtype: torch.dtype) -> None:
    """Every tile: <= the cap, <= max(4 × the rank's hidden bytes, the floor); the floor when the cap allows it."""
    elem = 8 if dtype == torch.float64 else 4
    plan = meta_plan(tokens, vocab, dim, dtype)
    tile = plan.tokens * plan.vocab * elem
    assert tile <= DEFAULT_MAX_CHUNK_BYTES
    assert tile <= max(TILE_HIDDEN_MULTIPLE * tokens * dim * elem, MIN_TILE_TOKENS * vocab * elem)
    assert tile_budget_bytes(tokens, dim, vocab, elem, DEFAULT_MAX_CHUNK_BYTES) >= tile
    if MIN_TILE_TOKENS * vocab * elem <= DEFAULT_MAX_CHUNK_BYTES and dtype != torch.bfloat16:
        assert plan.vocab == vocab and plan.tokens >= MIN_TILE_TOKENS
    if dtype == torch.bfloat16:  # the float32 cast of a weight block (and its d_weight block) within the cap
        assert plan.vocab * dim * 4 <= DEFAULT_MAX_CHUNK_BYTES


def test_cap_wins_and_explicit_sizes_win() -> None:
    small = meta_plan(1 << 16, 248_320, 64, max_chunk_bytes=2**19)
    assert small.tokens == 1 and small.vocab == 2**17
    assert meta_plan(10, 97, 16, chunk_tokens=3, chunk_vocab=5).tokens == 3
    assert tile_shape(10, 97, 16, acc_bytes=4, weight_bytes=4, chunk_vocab=500).vocab == 97
    with pytest.raises(ValueError, match="chunk_vocab"):
        tile_shape(10, 97, 16, acc_bytes=4, weight_bytes=4, chunk_vocab=0)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        tile_shape(10, 97, 16, acc_bytes=8, weight_bytes=8, max_chunk_bytes=7)


@pytest.mark.parametrize("upstream", [False, True])
def test_every_tile_of_forward_and_backward_within_budget(monkeypatch: pytest.MonkeyPatch, upstream: bool) -> None:
    """Spy on the tile matmul: forward and backward (or the one pass) compute only tiles of the planned shape,
    and the values still equal the plain reference (float64)."""
    tokens, vocab, dim, budget = 300, 1000, 8, 64 * 1000 * 8  # a cap of 64 whole-vocab rows
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    grad_out = torch.randn(tokens, generator=gen, dtype=torch.float64)
    plan = plan_tiles(hidden, weight, max_chunk_bytes=budget)
    assert (plan.tokens, plan.vocab) == (64, vocab)  # 4 × 300 × 8 hidden bytes < the floor (128 rows) > the cap
    shapes: list[tuple[int, int]] = []
    tile_logits = logprob_head._tile_logits

    def spy(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, buffer: torch.Tensor | None) -> torch.Tensor:
        out = tile_logits(h, w, b, buffer)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(logprob_head, "_tile_logits", spy)
    out = label_logprobs(hidden, weight, labels, max_chunk_bytes=budget, upstream=grad_out if upstream else None)
    got = torch.autograd.grad(out, (hidden, weight), grad_out)
    assert len(shapes) == (5 if upstream else 10)  # ceil(300 / 64) tiles per logits pass
    assert max(t * v * 8 for v, t in shapes) <= budget and all(v == vocab for v, _ in shapes)  # [vocab, tokens]
    want_out = reference_label_logprobs(hidden, weight, labels)
    want = torch.autograd.grad(want_out, (hidden, weight), grad_out)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
