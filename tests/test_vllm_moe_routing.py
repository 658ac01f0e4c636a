"""MoE routing (R3) and ``stable_reinforce`` with samples from a started vLLM CPU engine: a gateway over a tiny
random Qwen3-MoE (float32 :class:`LocalBackend` with ``record_routing``, ``routing_replay=True``) whose sampling
runs on vLLM (float32, eager, no LoRA).

vLLM answers the tokens and their log-probs; the routing of every sampled sequence comes from ringtune's forward
of its fed tokens (:mod:`ringtune.sample.engines.forward_routing`). Through the unmodified SDK: a sampling client
with ``record_stability_info`` samples, and its sequences' routing is replayed on every input token of a
``stable_reinforce`` datum with provenance and of a plain ``cross_entropy`` datum of the same tokens; the engine's
log-probs equal the trainer's with the replayed experts. The samples are of the base model (the training client's
weights before its first step): vLLM 0.32's CPU backend cannot reload a MoE's weights (``reload_weights`` fails
on its repacked fused-MoE tensors and the engine dies; docs/sampling.md), so a snapshot is not sampled. The
engine-free version of this path (a stand-in engine,
the tiny Qwen3.5-MoE) is ``test_vllm_forward_routing.py``.

Skipped with the reason when the engine interpreter has no vLLM (``make test-vllm`` runs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tinker
import torch
from vllm_fixtures import (
    API_KEY,
    MODEL_NAME,
    missing_engine_reason,
    rl_datum,
    start_vllm_gateway,
    test_engine,
    tiny_moe_dir,
)

pytestmark = pytest.mark.skipif(missing_engine_reason() is not None, reason=str(missing_engine_reason()))

PROMPT = [3, 17, 42, 8, 5, 60]
LOGPROB_TOLERANCE = 2e-4
"""float32 on both sides, different kernels (as test_vllm_sampling.py); a token the two routed differently would
be off by far more."""


@pytest.fixture(scope="module")
def sc(tmp_path_factory) -> Iterator[tinker.ServiceClient]:
    root = tmp_path_factory.mktemp("vllm-moe")
    model_dir = tiny_moe_dir(root / "moe")
    engine = test_engine(model_dir, root / "engine.log", enable_lora=False)
    server = start_vllm_gateway(root / "checkpoints", model_dir, engine, record_routing=True, routing_replay=True)
    try:
        with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as client:
            yield client
    finally:
        server.stop()


def test_engine_samples_carry_routing_for_stable_reinforce(sc):
    tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()  # the base weights until its first step
    sampler = sc.create_sampling_client(base_model=MODEL_NAME, record_stability_info=True).result()
    params = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop=[])
    result = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, params).result()
    assert [len(s.tokens) for s in result.sequences] == [8, 8]
    data = [rl_datum(PROMPT, seq, adv) for seq, adv in zip(result.sequences, [1.0, -1.0], strict=True)]
    inputs = sum(d.model_input.length for d in data)

    before = tc.forward(data, "stable_reinforce").result()
    metrics = before.metrics
    print(f"\nstable_reinforce on vLLM samples of a MoE: { {k: v for k, v in metrics.items() if 'moe/' not in k} }")
    assert metrics["routing_replay_tokens:sum"] == inputs, metrics  # every input token replays recorded experts
    assert abs(metrics["kl_sample_train_v1:mean"]) < 1e-4, metrics
    assert metrics["masked_token_frac:mean"] == 0.0 == metrics["masked_sequence_frac:mean"], metrics
    for seq, out in zip(result.sequences, before.loss_fn_outputs, strict=True):
        trainer = out["logprobs"].to_torch()[len(PROMPT) - 1 :]
        assert torch.allclose(torch.tensor(seq.logprobs), trainer, atol=LOGPROB_TOLERANCE), (seq.logprobs, trainer)

    # the same tokens in a plain cross_entropy datum: the routing records (R3 without provenance) match them too
    plain = [
        tinker.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": [1.0] * d.model_input.length,
            },
        )
        for d in data
    ]
    assert tc.forward(plain, "cross_entropy").result().metrics["routing_replay_tokens:sum"] == inputs

    out = tc.forward_backward(data, "stable_reinforce", {"kl_coef": 0.1}).result()
    assert out.metrics["loss:sum"] != 0.0, out.metrics
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    moved = tc.forward(data, "stable_reinforce").result()
    assert moved.metrics["kl_sample_train_v1:mean"] != metrics["kl_sample_train_v1:mean"]
