"""MoE routing (R3) and stability records of engine samples (``--sampler vllm --routing-replay``), without an engine.

vLLM cannot return ringtune's routing; :mod:`ringtune.sample.engines.forward_routing` takes it from ringtune's
forward of the sampled tokens. Here a stand-in engine answers every completion with fixed tokens (and the trainer's
own log-probs of them), and the rest is real: the gateway over a tiny Qwen3.5-MoE :class:`LocalBackend` (float32,
``record_routing``), the :class:`VllmSampler`, the unmodified SDK. vLLM 0.32's CPU backend does not serve this
model (its GatedDeltaNet needs bf16 and linear head size 128 there), so the engine is stood in for; the routing
comes from the same forward path either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import tinker
import torch
from gateway_fixtures import API_KEY, tiny_model_dir
from support.tiny_models import hf_model
from test_vllm_sampler_gates import REQUEST, RecordingBackend, RecordingEngine
from vllm_fixtures import rl_datum

from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.server import ServerThread
from ringtune.gateway.vllm_sampling import VllmSampler
from ringtune.sample.engines.forward_routing import routing_requests, with_routing
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.sampler import PromptSamples, SampledSequence
from ringtune.worker.local import LocalBackend

PROMPT = [3, 17, 42, 8]
SAMPLED = [5, 11, 9, 30, 2]


# ---- the pure request building and merging ----------------------------------------------------------------------


def _routing(n: int) -> torch.Tensor:
    return torch.arange(n * 3 * 2, dtype=torch.int16).reshape(n, 3, 2)


def test_routing_requests_and_merge():
    params = SamplingParams(max_tokens=4, temperature=1.0)
    plain = SampleRequest(prompt=[1, 2, 3], params=params, num_samples=2)
    seqs = [SampledSequence([4, 5], [-1.0, -2.0], "length"), SampledSequence([6], [-0.5], "stop")]
    results = [PromptSamples(sequences=seqs)]
    asks = routing_requests([plain], results)
    assert [a.prompt for a in asks] == [[1, 2, 3, 4], [1, 2, 3]]
    assert all(a.params.max_tokens == 1 and a.params.temperature == 0.0 and a.num_samples == 1 for a in asks)
    answers = [PromptSamples([SampledSequence([0], [0.0], "length", routing=_routing(len(a.prompt)))]) for a in asks]
    merged = with_routing([plain], results, answers)
    for seq, before, ask in zip(merged[0].sequences, seqs, asks, strict=True):
        assert torch.equal(seq.routing, _routing(len(ask.prompt)))  # [len(prompt) + len(tokens) - 1, L, k]
        assert (seq.tokens, seq.logprobs, seq.stop_reason) == (before.tokens, before.logprobs, before.stop_reason)
    dense = [PromptSamples([SampledSequence([0], [0.0], "length")]) for _ in asks]
    assert all(s.routing is None for s in with_routing([plain], results, dense)[0].sequences)
    with pytest.raises(ValueError, match="fewer answers"):
        with_routing([plain], results, answers[:1])
    with pytest.raises(ValueError, match="more answers"):
        with_routing([plain], results, answers + answers[:1])
    short = [PromptSamples([SampledSequence([0], [0.0], "length", routing=_routing(2))])] * 2
    with pytest.raises(ValueError, match="routing of 2 positions for 4 fed tokens"):
        with_routing([plain], results, short)


def test_the_routing_forward_runs_on_the_jobs_weights(tmp_path: Path):
    """With ``record_routing`` each finished job asks the backend's forward once, for all its sequences, on the
    weights the job sampled (here an inflight target republished while the job was in flight); without it the
    backend is never asked (a dense server pays nothing)."""
    engine, backend = RecordingEngine(), RecordingBackend()
    sampler = VllmSampler(engine, backend, tmp_path / "scratch", record_routing=True)
    sampler.create_sampler("first", SamplerSource(run_id="run-1", inflight=True))
    engine.hold.clear()
    assert sampler.sample("first", [REQUEST], job_id="j", slice_s=0.05) is None  # in flight on the first export
    sampler.create_sampler("second", SamplerSource(run_id="run-1", inflight=True))  # republished meanwhile
    first, _ = sampler.inflight["run-1"].exports
    engine.hold.set()
    assert sampler.sample_more("j", None) is not None
    assert [c[0] for c in backend.calls] == ["export", "export", "create", "sample"]
    forward = backend.calls[2][1]
    assert backend.calls[2] == ("create", forward, str(first)) and backend.calls[3] == ("sample", forward, 2)

    plain_backend = RecordingBackend()
    plain = VllmSampler(RecordingEngine(), plain_backend, tmp_path / "plain")
    plain.create_sampler("base", SamplerSource())
    assert plain.sample("base", [REQUEST]) is not None and plain_backend.calls == []


# ---- through the SDK on a MoE gateway whose sampling runs on a stand-in engine -----------------------------------


@dataclass(frozen=True)
class _Config:
    model: str
    served_name: str = "base"
    enable_lora: bool = False


class FixedEngine:
    """An engine stand-in: every completion's choices are ``tokens`` with ``logprobs`` (set by the test)."""

    def __init__(self, model: str) -> None:
        self.config = _Config(model)
        self.incarnation = 1
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.reloads: list[str] = []

    def check_serving(self) -> int:
        return self.incarnation

    def post(self, path, body=None, *, timeout_s=None):
        lp = {"tokens": [f"token_id:{t}" for t in self.tokens], "token_logprobs": self.logprobs}
        choice = {"token_ids": self.tokens, "logprobs": lp, "finish_reason": "length"}
        return {"choices": [choice | {"index": i} for i in range(body["n"])]}

    def load_lora_adapter(self, name, path):
        raise AssertionError("no LoRA in this test")

    def unload_lora_adapter(self, name):
        raise AssertionError("no LoRA in this test")

    def reload_weights(self, path):
        self.reloads.append(path)

    def stop(self):
        pass


def test_stable_reinforce_replays_routing_of_engine_samples(tmp_path: Path):
    model_dir = tiny_model_dir(tmp_path / "model")
    hf_model("qwen3_5_moe", seed=5).save_pretrained(model_dir)
    backend = LocalBackend(str(model_dir), max_tokens_per_rank=128, record_routing=True)
    engine = FixedEngine(str(model_dir))
    config = GatewayConfig(checkpoint_root=str(tmp_path / "ckpt"), api_key=API_KEY, routing_replay=True)
    server = ServerThread(backend, config, sampling_engine=engine)  # type: ignore[arg-type]
    with server as url, tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(str(model_dir), rank=0).result()
        scored = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(PROMPT + SAMPLED[:-1]),
            loss_fn_inputs={"target_tokens": PROMPT[1:] + SAMPLED, "weights": [1.0] * (len(PROMPT) + len(SAMPLED) - 1)},
        )
        trainer = tc.forward([scored], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        engine.tokens, engine.logprobs = SAMPLED, trainer[len(PROMPT) - 1 :].tolist()

        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = tinker.SamplingParams(max_tokens=len(SAMPLED), temperature=1.0, seed=4, stop=[])
        result = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, params).result()
        assert len(engine.reloads) == 1  # the run's export, reloaded on the (stand-in) engine
        assert [list(s.tokens) for s in result.sequences] == [SAMPLED, SAMPLED]
        # the stand-in's two samples are equal: advantages of one sign, so the loss is not zero
        data = [rl_datum(PROMPT, seq, adv) for seq, adv in zip(result.sequences, [1.0, 0.5], strict=True)]
        before = tc.forward(data, "stable_reinforce").result()
        # the routing ringtune's forward recorded for the engine's tokens is replayed on every input token
        assert before.metrics["routing_replay_tokens:sum"] == sum(d.model_input.length for d in data), before.metrics
        assert abs(before.metrics["kl_sample_train_v1:mean"]) < 1e-5, before.metrics
        assert before.metrics["masked_token_frac:mean"] == 0.0 == before.metrics["masked_sequence_frac:mean"]
        out = tc.forward_backward(data, "stable_reinforce", {"kl_coef": 0.1}).result()
        assert out.metrics["loss:sum"] != 0.0 and out.metrics["routing_replay_tokens:sum"] > 0, out.metrics
