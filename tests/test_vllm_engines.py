"""ringtune.gateway.vllm_engines through the sampler, without an engine: sessions placed over two engines by weight
gate and load, each engine's weights and adapters its own, one engine down failing only its sessions, a session of
an engine that gave up moving to another, and one engine set per served model (recording stand-ins; the real
engines: tests/test_vllm_two_engines.py)."""

from __future__ import annotations

import pytest
from test_vllm_sampler_gates import REQUEST, RecordingBackend, RecordingEngine, _export

from ringtune.gateway.vllm_engines import BASE_GATE, EngineSet
from ringtune.gateway.vllm_sampling import VllmSampler
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.worker.vllm_engine import EngineUnavailableError


class StoppableEngine(RecordingEngine):
    """A recording engine that can also give up (down for good)."""

    def __init__(self) -> None:
        super().__init__()
        self.gave_up = False


def _sampler(tmp_path, engines) -> tuple[VllmSampler, RecordingBackend]:
    backend = RecordingBackend()
    return VllmSampler(engines, backend, tmp_path / "scratch", max_concurrent=4), backend


def _served(engine: RecordingEngine) -> list[str]:
    return [c[2] for c in engine.calls if c[0] == "completion"]


def test_two_runs_full_snapshots_take_one_engine_each_and_never_reload_back_and_forth(tmp_path):
    engines = [StoppableEngine(), StoppableEngine()]
    sampler, _ = _sampler(tmp_path, {"m": engines})
    a, b = _export(tmp_path, "a"), _export(tmp_path, "b")
    sampler.create_sampler("sa", SamplerSource(path=a, model="m"))
    sampler.create_sampler("sb", SamplerSource(path=b, model="m"))
    sampler.create_sampler("sa2", SamplerSource(path=a, model="m"))  # the same snapshot: where a is held
    assert [sampler.sessions[s].slot.index for s in ("sa", "sb", "sa2")] == [0, 1, 0]
    for sid in ("sa", "sb", "sa2", "sb", "sa", "sb"):
        assert sampler.sample(sid, [REQUEST]) is not None
    assert _served(engines[0]) == [a, a, a] and _served(engines[1]) == [b, b, b]
    assert [c for c in engines[0].calls if c[0] == "reload"] == [("reload", a)]  # one reload each, then none
    assert [c for c in engines[1].calls if c[0] == "reload"] == [("reload", b)]


def test_base_and_lora_sessions_spread_by_load_adapters_per_engine(tmp_path):
    engines = [StoppableEngine(), StoppableEngine()]
    sampler, _ = _sampler(tmp_path, {"m": engines})
    one = _export(tmp_path, "one", lora=True)
    for sid in ("s0", "s1", "s2", "s3"):
        sampler.create_sampler(sid, SamplerSource(path=one))
    assert [sampler.sessions[s].slot.index for s in ("s0", "s1", "s2", "s3")] == [0, 1, 0, 1]
    assert sampler.sessions["s0"].weights.gate == BASE_GATE
    for sid in ("s0", "s1", "s2", "s3"):
        sampler.sample(sid, [REQUEST])
    for engine in engines:  # each engine loads the adapter once, for its own sessions
        assert [c[0] for c in engine.calls] == ["load", "completion", "completion"]
    sampler.free_sampler("s0")  # s2 still uses it on engine 0
    assert engines[0].calls[-1][0] == "completion"
    sampler.free_sampler("s2")
    assert engines[0].calls[-1][0] == "unload" and engines[1].calls[-1][0] == "completion"
    sampler.create_sampler("s4", SamplerSource())  # engine 0 is now the least loaded
    assert sampler.sessions["s4"].slot.index == 0


def test_one_engine_down_fails_only_its_sessions_and_a_given_up_engine_loses_them(tmp_path):
    engines = [StoppableEngine(), StoppableEngine()]
    sampler, _ = _sampler(tmp_path, {"m": engines})
    sampler.create_sampler("s0", SamplerSource())
    sampler.create_sampler("s1", SamplerSource())
    engines[0].down = True  # restarting
    with pytest.raises(EngineUnavailableError):
        sampler.sample("s0", [REQUEST])
    assert sampler.sample("s1", [REQUEST]) is not None  # the other engine serves on
    engines[0].gave_up = True  # out of restarts: its session moves on its next job
    assert sampler.sample("s0", [REQUEST]) is not None
    assert sampler.sessions["s0"].slot.index == 1 and len(_served(engines[1])) == 2
    sampler.create_sampler("s2", SamplerSource())  # new sessions avoid it
    assert sampler.sessions["s2"].slot.index == 1
    sampler.close()
    assert all(engine.calls[-1] == ("stop",) for engine in engines)


def test_each_served_model_samples_on_its_own_engines(tmp_path):
    student, teacher = StoppableEngine(), StoppableEngine()
    sampler, backend = _sampler(tmp_path, {"student": [student], "teacher": [teacher]})
    sampler.create_sampler("t", SamplerSource(model="teacher"))
    sampler.create_sampler("s", SamplerSource(model="student"))
    sampler.create_sampler("x", SamplerSource())  # no model named: the first one's
    assert [sampler.sessions[s].slot.engine for s in ("t", "s", "x")] == [teacher, student, student]
    asks = SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=1), prompt_logprobs=True)
    sampler.sample("t", [asks])  # the forward's session is made on the teacher's model
    assert len(_served(teacher)) == 1 and not _served(student)
    created = [c for c in backend.calls if c[0] == "create"]
    assert len(created) == 1 and created[0][1].startswith("t:forward")


def test_placement_rules_on_the_set_alone():
    engines = [StoppableEngine() for _ in range(3)]
    pool = EngineSet({"m": engines})
    placed = [pool.place("m", key).index for key in ("a@1", "b@1", "c@1", "a@1", BASE_GATE)]
    assert placed == [0, 1, 2, 0, 1]  # a new gate takes an engine of its own while there is one; then load
    pool.release(pool.slots_of("m")[2], "c@1")
    assert pool.place("m", "d@1").index == 2  # the freed engine holds no other gate
    with pytest.raises(ValueError, match="at least one engine"):
        EngineSet({"m": []})
