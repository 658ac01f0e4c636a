"""A logits tile's exps in cache-sized blocks and its unformed gradient (models/logprob_tile_grads.py), through the
head against the plain log_softmax reference, with blocks of one row up to one block per tile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringtune.models import logprob_tile_grads
from ringtune.models.logprob_head import label_logprobs, reference_label_logprobs
from ringtune.models.logprob_tile_grads import block_rows

T, D, V, IGNORE = 19, 8, 37, -100

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tiles (conftest.one_thread)


def _case(k: int, bias: bool, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_() if bias else None
    labels = torch.randint(0, V, (T, k), generator=gen)
    labels[[1, 7], 0] = IGNORE
    grad_out = torch.randn(T, k, generator=gen, dtype=torch.float64)
    return hidden, weight, b, labels, grad_out


def _values_and_grads(fn, hidden, weight, b, labels, grad_out, **kw):
    out = fn(hidden, weight, labels, bias=b, **kw)
    leaves = [x for x in (hidden, weight, b) if x is not None]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


@pytest.mark.parametrize("block_bytes", [1, 3 * 8 * 8, None])  # one row, a few rows, the default (one block)
@pytest.mark.parametrize(
    ("one_pass", "k", "bias", "chunk_vocab"),
    [
        (True, 1, False, None),
        (True, 2, True, None),
        (False, 1, False, None),
        (False, 2, True, None),
        (False, 2, True, 10),
    ],
)  # one pass needs tiles over the whole vocabulary: the split vocabulary is a two-pass case
def test_blocks_equal_reference_float64(monkeypatch, block_bytes, one_pass, k, bias, chunk_vocab):
    """Values and every gradient within 1e-10 of the reference (float64: summation order only), K labels per
    token, ignored entries, a bias, the vocabulary split into blocks (two-pass only) and 8-token tiles."""
    if block_bytes is not None:
        monkeypatch.setattr(logprob_tile_grads, "CACHE_BLOCK_BYTES", block_bytes)
    hidden, weight, b, labels, grad_out = _case(k, bias)
    want = _values_and_grads(reference_label_logprobs, hidden, weight, b, labels, grad_out)
    kw = {"upstream": grad_out} if one_pass else {}
    got = _values_and_grads(
        label_logprobs, hidden, weight, b, labels, grad_out, chunk_tokens=8, chunk_vocab=chunk_vocab, **kw
    )
    for name, g, w in zip(["logprobs", "d_hidden", "d_weight", "d_bias"], got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_block_rows_cover_the_tile_once(monkeypatch):
    monkeypatch.setattr(logprob_tile_grads, "CACHE_BLOCK_BYTES", 5 * 4 * 8)  # 5 rows of 8 float32 tokens
    ranges = block_rows(torch.zeros(23, 8))
    assert ranges[0] == (0, 5) and ranges[-1] == (20, 23)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(23))
    assert block_rows(torch.zeros(0, 8)) == []


def test_negative_control_label_part_dropped(monkeypatch):
    """The same comparison sees a gradient without its one-hot part (labels' rows of W and h not added)."""
    hidden, weight, b, labels, grad_out = _case(2, True)
    want = _values_and_grads(reference_label_logprobs, hidden, weight, b, labels, grad_out)
    add = logprob_tile_grads.TileGrads.add

    def without_labels(self, rows, tile, h_tile, w_block):
        add(self, rows, dataclasses.replace(tile, g=torch.zeros_like(tile.g)), h_tile, w_block)

    monkeypatch.setattr(logprob_tile_grads.TileGrads, "add", without_labels)
    got = _values_and_grads(label_logprobs, hidden, weight, b, labels, grad_out, chunk_tokens=8, upstream=grad_out)
    assert all((g - w).abs().max() > 1e-3 for g, w in zip(got[1:], want[1:], strict=True))
