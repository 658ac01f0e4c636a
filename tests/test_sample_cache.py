"""ringtune.models.cache and .batch_cache: prefill capture and the decode batch, on whole tiny models (float64).

- A capture leaves the prefill's hidden states bit-identical to the plain training forward on real tokens.
- Decoding rows of different lengths (some joining late, some leaving) gives, at every step, the logits a
  full forward over each sequence gives at its last token, within 1e-10.
- Rows move in and out intact: ``sequence(b)`` of a batch equals the captured cache; the KV buffer grows.
"""

from __future__ import annotations

import pytest
import torch

from ringtune.errors import ParallelConfigError
from ringtune.layout import zigzag_slice
from ringtune.layout.zigzag import zigzag_plan
from ringtune.models.batch_cache import GROWTH_MIN, DecodeBatch, KVRows
from ringtune.models.cache import AttentionState, PrefillCapture
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.shard import shard_of
from tests.sample_fixtures import (
    random_prompts,
    sharp_checkpoint,
    single_thread,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


@pytest.fixture(scope="module", params=["qwen3_5", "llama", "qwen3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    sharp_checkpoint(request.param, path)
    return load_hf(path, dtype=F64).eval()


def prefill(model, prompts):
    shard = shard_of([len(p) for p in prompts])
    capture = PrefillCapture(shard.plan, len(model.model.layers))
    ids = zigzag_slice(torch.tensor([t for p in prompts for t in p]), shard.plan)
    return model.hidden_states(ids, shard, capture=capture), capture, shard, ids


def last_logits(model, seqs):
    """Logits at the last token of every sequence, by the training forward over the whole sequences."""
    shard = shard_of([len(s) for s in seqs])
    h = model.hidden_states(zigzag_slice(torch.tensor([t for s in seqs for t in s]), shard.plan), shard)
    last = [s + len(q) - 1 for s, q in zip(shard.plan.local_starts, seqs, strict=True)]
    return h[last] @ model.output_weight.t()


@torch.inference_mode()
def test_capture_keeps_training_hidden_states(model):
    prompts = random_prompts((1, 4, 7, 70), 96, seed=0)  # odd lengths have a tail pad at CP = 1
    hidden, capture, shard, ids = prefill(model, prompts)
    plain = model.hidden_states(ids, shard)
    real = shard.plan.is_real
    assert torch.equal(hidden[real], plain[real])
    caches = capture.sequences()
    assert [c.length for c in caches] == [1, 4, 7, 70]
    for c in caches:
        for state in c.layers:
            if isinstance(state, AttentionState):
                assert state.k.shape[0] == c.length
            else:
                assert state.conv.shape[0] == model.config.linear_conv_kernel_dim - 1


@torch.inference_mode()
def test_batched_decode_equals_full_forward(model):
    """Two prompts decode; after 3 steps one leaves and two more join; each step's logits match a full forward."""
    prompts = random_prompts((5, 1, 9, 2), 96, seed=1)
    _, capture, _, _ = prefill(model, prompts[:2])
    batch = DecodeBatch.of(capture.sequences())
    seqs = [list(p) for p in prompts[:2]]
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for step in range(8):
        if step == 3:
            batch.keep([1])
            seqs = [seqs[1]]
            _, cap2, _, _ = prefill(model, prompts[2:])
            batch.join(cap2.sequences())
            seqs += [list(p) for p in prompts[2:]]
        nxt = torch.randint(0, 96, (len(seqs),), generator=gen)
        for s, t in zip(seqs, nxt.tolist(), strict=True):
            s.append(t)
        got = model.decode_hidden(nxt, batch) @ model.output_weight.t()
        worst = max(worst, float((got - last_logits(model, seqs)).abs().max()))
        assert batch.lengths.tolist() == [len(s) for s in seqs]
    assert worst < 1e-10


@torch.inference_mode()
def test_rows_round_trip_and_growth(model):
    prompts = random_prompts((3, 6), 96, seed=2)
    _, capture, _, _ = prefill(model, prompts)
    caches = capture.sequences()
    batch = DecodeBatch.of(caches)
    for b, cache in enumerate(caches):
        back = batch.sequence(b)
        assert back.length == cache.length
        for got, want in zip(back.layers, cache.layers, strict=True):
            for name in ("k", "v") if isinstance(want, AttentionState) else ("state", "conv"):
                assert torch.equal(getattr(got, name), getattr(want, name))
    capacities = [layer.capacity for layer in batch.layers if isinstance(layer, KVRows)]
    assert capacities and set(capacities) == {6 + GROWTH_MIN}
    batch.reserve(GROWTH_MIN + 1)  # more than the free slots: every KV buffer grows, rows kept
    grown = [layer.capacity for layer in batch.layers if isinstance(layer, KVRows)]
    assert min(grown) >= 6 + GROWTH_MIN + 1
    seqs = [list(p) for p in prompts]
    for t in (5, 7):
        got = model.decode_hidden(torch.tensor([t, t]), batch) @ model.output_weight.t()
        for s in seqs:
            s.append(t)
        assert (got - last_logits(model, seqs)).abs().max() < 1e-10


def test_capture_at_cp_above_one_needs_the_group():
    with pytest.raises(ParallelConfigError, match="cp_size=2 needs the CP group"):
        PrefillCapture(zigzag_plan([4], cp_size=2, cp_rank=0), 2)
