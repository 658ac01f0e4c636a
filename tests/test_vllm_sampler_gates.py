"""ringtune.gateway.vllm_sampling without an engine: which weights the engine holds when each job's completions
are sent, adapters per engine incarnation, the forward's part, failures. A recording stand-in answers the engine's
calls (the real engine: tests/test_vllm_sampling.py)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from ringtune.errors import UserInputError
from ringtune.gateway.vllm_sampling import BASE_GATE, VllmSampler
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.sampler import PromptSamples, SampledSequence
from ringtune.worker.vllm_engine import EngineUnavailableError


@dataclass(frozen=True)
class _Config:
    model: str = "/base"
    served_name: str = "base"
    enable_lora: bool = True


class RecordingEngine:
    """Answers completions with one token (the number of reloads so far) and records every call in order;
    ``hold`` keeps completions in flight until released."""

    def __init__(self) -> None:
        self.config = _Config()
        self.incarnation = 1
        self.calls: list[tuple] = []
        self.weights = "/base"
        self.hold = threading.Event()
        self.hold.set()
        self.down = False

    def check_serving(self) -> int:
        if self.down:
            raise EngineUnavailableError("the vLLM engine is failed")
        return self.incarnation

    def post(self, path, body=None, *, timeout_s=None):
        self.check_serving()
        self.hold.wait(10)
        self.calls.append(("completion", body["model"], self.weights))
        n = body["n"]
        choice = {"token_ids": [1], "logprobs": {"tokens": ["token_id:1"], "token_logprobs": [-0.5]}}
        return {"choices": [choice | {"index": i, "finish_reason": "length"} for i in range(n)]}

    def load_lora_adapter(self, name, path):
        self.calls.append(("load", name))

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))

    def reload_weights(self, path):
        self.calls.append(("reload", path))
        self.weights = path

    def stop(self):
        self.calls.append(("stop",))


class RecordingBackend:
    """The backend's export and built-in forward, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def export_for_sampler(self, run_id, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(run_id.encode())
        self.calls.append(("export", run_id))

    def create_sampler(self, sampler_id, source):
        self.calls.append(("create", sampler_id, source.path))

    def free_sampler(self, sampler_id):
        self.calls.append(("free", sampler_id))

    def sample(self, sampler_id, requests):
        self.calls.append(("sample", sampler_id, len(requests)))
        seq = SampledSequence(tokens=[0], logprobs=[0.0], stop_reason="length")
        return [PromptSamples(sequences=[seq], prompt_logprobs=[None] + [-1.0] * (len(r.prompt) - 1)) for r in requests]


def _export(root: Path, name: str, *, lora: bool = False) -> str:
    path = root / name
    path.mkdir()
    (path / "model.safetensors").write_bytes(name.encode())
    if lora:
        (path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    return str(path)


REQUEST = SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=1), num_samples=2)


@pytest.fixture
def parts(tmp_path):
    engine, backend = RecordingEngine(), RecordingBackend()
    return engine, backend, VllmSampler(engine, backend, tmp_path / "scratch", max_concurrent=4), tmp_path


def test_full_weights_alternated_reload_before_each_switch(parts):
    engine, _, sampler, root = parts
    a, b = _export(root, "a"), _export(root, "b")
    sampler.create_sampler("sa", SamplerSource(path=a))
    sampler.create_sampler("sb", SamplerSource(path=b))
    sampler.create_sampler("base", SamplerSource())
    for sid in ("sa", "sb", "sa", "base", "sa", "sa"):
        result = sampler.sample(sid, [REQUEST])
        assert result is not None and len(result[0].sequences) == 2
    served = [c[2] for c in engine.calls if c[0] == "completion"]
    assert served == [a, b, a, "/base", a, a]  # every completion ran on the weights its session names
    assert [c for c in engine.calls if c[0] == "reload"] == [("reload", p) for p in (a, b, a, "/base", a)]


def test_a_job_of_other_weights_waits_for_the_held_ones_in_flight(parts):
    engine, _, sampler, root = parts
    a, b = _export(root, "a"), _export(root, "b")
    sampler.create_sampler("sa", SamplerSource(path=a))
    sampler.create_sampler("sb", SamplerSource(path=b))
    engine.hold.clear()
    assert sampler.sample("sa", [REQUEST], job_id="ja", slice_s=0.05) is None  # in flight on a
    assert sampler.sample("sb", [REQUEST], job_id="jb", slice_s=0.05) is None  # waits: a is in flight
    assert engine.weights == a and sampler.jobs["jb"].futures == []
    engine.hold.set()
    assert sampler.sample_more("ja", None) is not None
    assert sampler.sample_more("jb", None) is not None
    assert [c[2] for c in engine.calls if c[0] == "completion"] == [a, b]


def test_lora_sessions_share_the_base_and_load_adapters_once_per_incarnation(parts):
    engine, _, sampler, root = parts
    one, two = _export(root, "one", lora=True), _export(root, "two", lora=True)
    sampler.create_sampler("s1", SamplerSource(path=one))
    sampler.create_sampler("s2", SamplerSource(path=two))
    sampler.create_sampler("s1b", SamplerSource(path=one))
    for sid in ("s1", "s2", "s1b", "s1"):
        sampler.sample(sid, [REQUEST])
    names = [c[1] for c in engine.calls if c[0] == "completion"]
    assert names[0] == names[2] == names[3] != names[1] and names[0].startswith("ringtune-lora-")
    assert [c[0] for c in engine.calls].count("load") == 2 and not any(c[0] == "reload" for c in engine.calls)
    assert sampler.sessions["s1"].weights.gate == BASE_GATE
    engine.incarnation = 2  # the engine restarted: its adapters are gone
    sampler.sample("s1", [REQUEST])
    assert [c[0] for c in engine.calls].count("load") == 3
    sampler.free_sampler("s1")  # s1b still uses the adapter
    assert not any(c[0] == "unload" for c in engine.calls)
    sampler.free_sampler("s1b")
    assert engine.calls[-1] == ("unload", names[0])


def test_live_run_is_exported_and_prompt_asks_go_to_the_forward(parts):
    _, backend, sampler, _ = parts
    sampler.create_sampler("live", SamplerSource(run_id="run-1"))
    scratch = sampler.sessions["live"].scratch
    assert backend.calls == [("export", "run-1")] and scratch is not None and scratch.is_dir()
    asks = SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=1), prompt_logprobs=True)
    (result,) = sampler.sample("live", [asks])
    assert result.prompt_logprobs == [None, -1.0, -1.0] and result.sequences[0].tokens == [1]  # forward + engine
    forward = backend.calls[1][1]
    assert backend.calls[1] == ("create", forward, str(scratch)) and forward.startswith("live:forward")
    assert backend.calls[2][:2] == ("sample", forward)
    sampler.free_sampler("live")
    assert backend.calls[-1] == ("free", forward) and not scratch.exists()


def test_inflight_sessions_sample_the_newest_publish(parts):
    engine, backend, sampler, _ = parts
    sampler.create_sampler("first", SamplerSource(run_id="run-1", inflight=True))
    sampler.sample("first", [REQUEST])
    sampler.create_sampler("second", SamplerSource(run_id="run-1", inflight=True))  # republishes the run's weights
    exports = list(sampler.inflight["run-1"].exports)
    assert len(exports) == 2 and all(p.is_dir() for p in exports)
    sampler.sample("first", [REQUEST])  # the earlier session now samples the newer publish
    served = [c[2] for c in engine.calls if c[0] == "completion"]
    assert served == [str(exports[0]), str(exports[1])]
    sampler.free_sampler("second")
    assert all(p.is_dir() for p in exports)  # "first" still samples the target
    sampler.free_sampler("first")
    assert "run-1" not in sampler.inflight and not any(p.exists() for p in exports)
    assert [c[0] for c in backend.calls] == ["export", "export"]


def test_unknown_session_and_a_down_engine(parts):
    engine, _, sampler, _ = parts
    with pytest.raises(UserInputError, match="no such sampling session"):
        sampler.sample("nope", [REQUEST])
    sampler.create_sampler("base", SamplerSource())
    engine.down = True
    with pytest.raises(EngineUnavailableError):
        sampler.sample("base", [REQUEST], job_id="j")
    assert "j" not in sampler.jobs  # a failed job is forgotten
    engine.down = False
    assert sampler.sample("base", [REQUEST]) is not None
    sampler.close()
    assert engine.calls[-1] == ("stop",)
