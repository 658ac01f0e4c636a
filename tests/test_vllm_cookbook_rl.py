"""The unmodified cookbook RL trainer (``tinker_cookbook.rl.train.main``) against ``ringtune serve --sampler vllm``:
every rollout sampled on a started vLLM CPU engine, training on ringtune's rank.

The model is the built-in test's (``test_cookbook_rl.py``): a tiny random Llama with SmolLM2's real tokenizer
and one learnable direction shared by every token without ASCII letters, widened for vLLM's CPU attention
(hidden 128, 4 heads of 32; head size >= 32). The engine serves it in float32, eager, without LoRA (full
fine-tuning runs: each step's ``save_weights_for_sampler`` is a whole-weight reload of the engine).

- ``test_rl_train_on_engine_samples``: the async mode with its default loss ``stable_reinforce`` (sampling
  clients made with ``record_stability_info``: every engine sample is recorded, every datum carries provenance
  the server resolves against those records), one step off-policy, the non-letter-fraction reward: it rises, and
  ``optim/kl_sample_train_v1/v2`` (engine log-probs vs the trainer's) are at float32 rounding.
- ``test_rl_train_sync_with_kl_penalty``: the sync mode (``importance_sampling``) with a KL penalty against the
  base model (``compute_logprobs`` on the engine), ``compute_post_kl`` and the evaluator, 2 steps: on-policy.
- ``test_stable_reinforce_on_engine_records``: the SDK path that recipe takes, by hand: a sampling client with
  ``record_stability_info``, datums with the recorded spans, ``forward`` / ``forward_backward`` with
  ``stable_reinforce``; the recorded log-probs are the engine's (what the client received).

Skipped with the reason when the engine interpreter has no vLLM (``make test-vllm`` runs it). One server (and one
engine) serves the module.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from smollm_fixtures import cookbook_server, tiny_smollm_class_dir
from test_cookbook_rl import (
    LLAMA_NAME,
    RENDERER,
    LettersDatasetBuilder,
    assert_on_policy,
    async_letters_steps,
    read_jsonl,
    reward_rose,
    rl_config,
)
from tinker_cookbook.rl import train
from vllm_fixtures import ENGINE_KV_CACHE_GIB, engine_python, missing_engine_reason, rl_datum

from ringtune.worker.vllm_options import PYTHON_ENV

pytestmark = pytest.mark.skipif(missing_engine_reason() is not None, reason=str(missing_engine_reason()))

API_KEY = "tml-vllm-cookbook-rl"
WIDE = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}
"""The tiny SmolLM2-vocabulary Llama widened to what vLLM's CPU attention takes (4 heads of 32)."""

CLASS_SCALE = 3.0
"""The class direction's scale: at hidden 128 the final norm's output on the two class dims is about twice the
hidden-32 model's (its RMS is spread over 4x the dims), so half test_cookbook_rl's scale 6 gives the same logits."""

STEPS = 8
"""Steps of the async run (test_cookbook_rl's count: the reward's jump came by step 3 in every run measured)."""


def class_model(dest: Path) -> Path:
    return tiny_smollm_class_dir(dest, scale=CLASS_SCALE, **WIDE)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("vllm-cookbook-rl")
    engine = ("--sampler", "vllm", "--vllm-python", engine_python(), "--vllm-args=--enforce-eager", "--no-vllm-lora")
    extra = ("--model-name", LLAMA_NAME, *engine)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", ENGINE_KV_CACHE_GIB)
        env.setenv(PYTHON_ENV, engine_python())
        with cookbook_server(root, api_key=API_KEY, context_length=1024, extra_args=extra, make_model=class_model) as s:
            yield s


def test_rl_train_on_engine_samples(server, tmp_path):
    steps = async_letters_steps(server, tmp_path / "rl-async", STEPS)
    rewards = [r["env/all/reward/total"] for r in steps]
    v1 = [r["optim/kl_sample_train_v1"] for r in steps]
    v2 = [r["optim/kl_sample_train_v2"] for r in steps]
    print(f"\nvLLM sampler, async stable_reinforce, reward by step: {[round(r, 3) for r in rewards]}")
    print(f"optim/kl_sample_train_v1 by step: {[f'{v:.2e}' for v in v1]}")
    print(f"optim/kl_sample_train_v2 by step: {[f'{v:.2e}' for v in v2]}")
    for row in steps:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    # on-policy steps (staleness 0) compare the engine's log-probs with the trainer's forward of the same weights:
    # float32 on both sides, different kernels (docs/sampling.md measured |d| <= 2e-5 per token)
    fresh = [r for r in steps if r.get("async/staleness_max", 0) == 0]
    assert fresh, "no on-policy step"
    for row in fresh:
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-4 and 0.0 <= row["optim/kl_sample_train_v2"] < 1e-6, row
    assert reward_rose(rewards), rewards
    records = list((server["root"] / "checkpoints" / ".stability_records").glob("*.jsonl"))
    assert records, "the sampling clients recorded nothing"
    assert server["proc"].proc.poll() is None, server["proc"].log_tail()


def test_rl_train_sync_with_kl_penalty(server, tmp_path):
    """The sync mode's other asks of the sampler: ``importance_sampling`` on fresh samples, a KL penalty against
    the base model (``compute_logprobs``: the engine's prompt log-probs, served without LoRA),
    ``compute_post_kl`` and the test-set evaluator, for 2 steps."""
    model = str(server["model_dir"])
    log_path = tmp_path / "rl-sync"
    builder = LettersDatasetBuilder(model_name=model, renderer_name=RENDERER, batch_size=2, group_size=4)
    kl = {"kl_penalty_coef": 0.01, "kl_reference_config": train.KLReferenceConfig(base_model=model)}
    config = rl_config(server, log_path, builder, max_steps=2, eval_every=2, compute_post_kl=True, **kl)
    asyncio.run(train.main(config))

    rows = read_jsonl(log_path / "metrics.jsonl")
    steps = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert [r["step"] for r in steps] == [0, 1], [r["step"] for r in rows]
    print(f"\nvLLM sampler, sync importance_sampling: {[_kl_figures(r) for r in steps]}")
    for row in steps:
        assert_on_policy(row)  # engine log-probs vs the trainer's, on-policy: float32 rounding
        assert row["grad_norm:mean"] > 0
        assert row["kl_pre_post_v2"] > 1e-6  # the next sampler (a reload of the new weights) serves them
    assert abs(steps[0]["kl_policy_base"]) < 1e-4, steps[0]  # step 0 samples the base: policy == reference
    evals = [r for r in rows if "test/env/all/reward/total" in r]
    assert [r["step"] for r in evals] == [0, 2], evals
    assert server["proc"].proc.poll() is None, server["proc"].log_tail()


def _kl_figures(row: dict) -> dict[str, str]:
    keys = ("optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "kl_policy_base", "kl_pre_post_v2")
    return {key.removeprefix("optim/"): f"{row[key]:.2e}" for key in keys}


PROMPT_TEXT = "User: Say hello.\n\nAssistant:"


def test_stable_reinforce_on_engine_records(server):
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(LLAMA_NAME, rank=0).result()
        prompt = tc.get_tokenizer().encode(PROMPT_TEXT)
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=4, stop=[])
        result = sampler.sample(tinker.ModelInput.from_ints(prompt), 2, params).result()
        data = [rl_datum(prompt, seq, adv) for seq, adv in zip(result.sequences, [1.0, -1.0], strict=True)]
        recorded = _recorded(server["root"], [s.sequence_id for s in result.sequences])
        for seq in result.sequences:  # the record holds exactly what the client received from the engine
            assert recorded[seq.sequence_id]["tokens"] == list(seq.tokens)
            assert recorded[seq.sequence_id]["logprobs"] == list(seq.logprobs)
        before = tc.forward(data, "stable_reinforce").result()
        metrics = before.metrics
        assert abs(metrics["kl_sample_train_v1:mean"]) < 1e-4, metrics
        assert metrics["masked_token_frac:mean"] == 0.0 == metrics["masked_sequence_frac:mean"], metrics
        out = tc.forward_backward(data, "stable_reinforce", {"kl_coef": 0.1}).result()
        assert out.metrics["loss:sum"] != 0.0, out.metrics
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        moved = tc.forward(data, "stable_reinforce").result()
        assert moved.metrics["kl_sample_train_v1:mean"] != metrics["kl_sample_train_v1:mean"]


def _recorded(root: Path, sequence_ids: list[str]) -> dict[str, dict]:
    """The persisted stability records of ``sequence_ids`` (``<checkpoint root>/.stability_records``)."""
    lines = [
        json.loads(line)
        for path in (root / "checkpoints" / ".stability_records").glob("*.jsonl")
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    found = {line["sequence_id"]: line for line in lines if line["sequence_id"] in sequence_ids}
    assert sorted(found) == sorted(sequence_ids), (sequence_ids, sorted(found))
    return found
