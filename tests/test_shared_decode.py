"""Several generations in one decode batch (ringtune.sample.shared_decode): LoRA snapshots of one base and the
base itself, each row with its own adapters, head, sampling parameters and generator.

float64, tiny Qwen3.5 hybrid (GatedDeltaNet recurrent state and attention KV caches in one batch): every
generation's tokens, sample log-probs and prompt log-probs equal the same generation run alone to 1e-10,
while the shared batch really held the rows of every model at once (one base forward per step for all of
them). The adapters visibly change the samples (a step that gave every row the same adapters would fail).
A failed shared step fails every generation in it; an abandoned generation's rows leave the batch and the
others go on unchanged; the pool shares one batch across sessions and jobs.
"""

from __future__ import annotations

import pytest
import torch
from support.lora import randomize_adapters
from support.tiny_models import hf_model

from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.lora import LoraModel, LoraSpec
from ringtune.models.lora_snapshot import LoraSnapshot
from ringtune.sample import SamplingParams, generate
from ringtune.sample.pool import SampleRequest, SamplerPool, SamplerSource
from ringtune.sample.sampler import start_generation
from ringtune.sample.shared_decode import SharedDecodes

PROMPTS = [[3, 17, 42, 8, 5], [9], [11, 2, 60, 61, 7, 7, 1, 30]]
SPECS = [  # different ranks and target sets: each hooked module sees a different subset of the runs
    LoraSpec(rank=4, seed=1),
    LoraSpec(rank=2, seed=2, train_mlp=False, train_unembed=False),
    LoraSpec(rank=8, seed=3, train_attn=False),
]
TOL = 1e-10  # float64: the same ops per row; only summation order within a batched matmul may differ


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=7, temperature=1.0, seed=seed, stop=[])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The frozen base and three LoRA snapshots on it (nonzero adapters)."""
    path = tmp_path_factory.mktemp("shared-decode") / "qwen3_5"
    hf_model("qwen3_5", seed=31).save_pretrained(path)
    base = load_hf(path, dtype=torch.float64)
    snapshots = []
    for i, spec in enumerate(SPECS):
        lora = LoraModel(base, spec)
        randomize_adapters(lora, seed=40 + i, std=0.2)
        snapshots.append(LoraSnapshot(lora))
    return base, snapshots


def assert_same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert len(a.sequences) == len(b.sequences)
        for s, r in zip(a.sequences, b.sequences, strict=True):
            assert s.tokens == r.tokens
            assert max(abs(x - y) for x, y in zip(s.logprobs, r.logprobs, strict=True)) <= TOL
        if b.prompt_logprobs is not None:
            pairs = zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
            assert max((abs(x - y) for x, y in pairs), default=0.0) <= TOL


def test_lora_snapshots_and_the_base_decode_in_one_batch(models):
    base, snapshots = models
    owners = [*snapshots, base]
    alone = [generate(m, PROMPTS, params(7 + i), num_samples=2, prompt_logprobs=True) for i, m in enumerate(owners)]
    # the adapters change what is sampled: rows given another run's adapters could not pass the checks below
    for result in alone[:-1]:
        pairs = zip(result[0].prompt_logprobs[1:], alone[-1][0].prompt_logprobs[1:], strict=True)
        assert max(abs(x - y) for x, y in pairs) > 1e-3

    decodes = SharedDecodes()
    gens = [
        start_generation(m, PROMPTS, params(7 + i), num_samples=2, prompt_logprobs=True, decodes=decodes)
        for i, m in enumerate(owners)
    ]
    # one slice each (a deadline already past: one admission and one step), in turn, as decode jobs run
    for gen in gens:
        gen.advance(deadline=0.0)
    shared = gens[0].decode
    assert shared is not None and all(g.decode is shared for g in gens)
    assert len(shared) == sum(g.running for g in gens) > gens[0].running
    assert decodes.stats.peak_models == len(owners)
    while not all(g.finished for g in gens):
        for gen in gens:
            if not gen.finished:
                gen.advance(deadline=0.0)
    for gen, want in zip(gens, alone, strict=True):
        assert_same(gen.results(), want)
    # every row-step of every generation went through a step shared with the others
    alone_steps = sum(len(s.tokens) - 1 for result in alone for p in result for s in p.sequences)
    assert decodes.stats.rows == alone_steps and decodes.stats.steps < alone_steps / 4


def test_a_failed_shared_step_fails_every_generation_in_it(models):
    _, snapshots = models
    calls = {"n": 0}

    def flaky_decode(ids: list[int]) -> str:  # the stop-string detokenizer; fails on its 6th call
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("detokenizer crashed")
        return " ".join(map(str, ids))

    decodes = SharedDecodes()
    stopping = SamplingParams(max_tokens=7, temperature=1.0, seed=3, stop=["never"])
    flaky = start_generation(snapshots[0], PROMPTS, stopping, decode=flaky_decode, decodes=decodes)
    other = start_generation(snapshots[1], PROMPTS, params(4), decodes=decodes)
    other.advance(deadline=0.0)
    with pytest.raises(RuntimeError, match="detokenizer crashed"):
        flaky.advance()
    assert not other.finished and not flaky.finished
    with pytest.raises(RuntimeError, match="detokenizer crashed"):  # told, not dropped
        other.advance()
    assert other.decode is not None and len(other.decode) == 0


def test_an_abandoned_generation_leaves_the_batch(models):
    _, snapshots = models
    want = generate(snapshots[2], PROMPTS, params(5), num_samples=3)
    decodes = SharedDecodes()
    dropped = start_generation(snapshots[0], PROMPTS, params(6), num_samples=2, decodes=decodes)
    kept = start_generation(snapshots[2], PROMPTS, params(5), num_samples=3, decodes=decodes)
    dropped.advance(deadline=0.0)
    kept.advance(deadline=0.0)
    assert dropped.running and kept.decode is dropped.decode
    dropped.close()
    assert len(kept.decode) == kept.running
    kept.advance()
    assert_same(kept.results(), want)


def test_the_pool_shares_one_batch_across_sessions_and_jobs(tmp_path):
    path = tmp_path / "qwen3_5"
    hf_model("qwen3_5", seed=8).save_pretrained(path)
    results = {}
    for shared in (True, False):
        pool = SamplerPool(lambda p: load_hf(path, dtype=torch.float64), shared_decode=shared)
        pool.create("a", SamplerSource(), {})
        pool.create("b", SamplerSource(), {})
        jobs = [
            pool.begin("a", [SampleRequest(prompt=p, params=params(1)) for p in PROMPTS]),
            pool.begin("b", [SampleRequest(prompt=PROMPTS[0], params=params(2), num_samples=4)]),
        ]
        while not all(job.finished for job in jobs):
            for job in jobs:
                job.advance(deadline=0.0)
        results[shared] = [job.results() for job in jobs]
        assert (pool.decodes.stats.peak_models, pool.decodes.stats.peak_rows > 4) == (1, shared)
    for got, want in zip(results[True], results[False], strict=True):
        assert_same(got, want)
