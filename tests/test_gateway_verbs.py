"""ringtune.gateway.verbs: the verb table read from the Backend protocol and the proxies derived from it.

No model and no process group: a recording backend stands behind the proxies, so every case checks what the
derived methods pass on (names, defaults, commands) and what the observer writes.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any

import pytest

from ringtune.engine.optimizer import AdamParams
from ringtune.gateway.backend import VERBS, Backend, BackendHealth, BackendInfo
from ringtune.gateway.observe import ObservedBackend
from ringtune.gateway.verbs import Verb, forward_verbs, verb, verbs_of
from ringtune.worker.commands import OPS

INFO = BackendInfo(
    model_name="m", arch="llama", tokenizer_dir=None, context_length=64, max_tokens_per_rank=64, dtype="float32",
    vocab_size=10,
)  # fmt: skip


@forward_verbs(VERBS)
class Recorder:
    """Answers info/health/close itself; records every other verb as (name, arguments) and answers ``reply``."""

    def __init__(self, reply: Any = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.reply = reply

    def info(self) -> BackendInfo:
        return INFO

    def models(self) -> tuple[BackendInfo, ...]:
        return (INFO,)

    def health(self) -> BackendHealth:
        return BackendHealth(ok=True)

    def close(self) -> None:
        self.calls.append(("close", {}))

    def call_verb(self, one: Verb, arguments: dict[str, Any]) -> Any:
        self.calls.append((one.name, arguments))
        return self.reply(one, arguments) if callable(self.reply) else self.reply


def test_the_table_is_the_protocol_in_declaration_order():
    protocol_methods = [n for n, m in vars(Backend).items() if inspect.isfunction(m) and not n.startswith("_")]
    assert list(VERBS) == protocol_methods
    assert VERBS["export_for_sampler"].command == "export_hf"
    assert {n for n, v in VERBS.items() if v.command is None} == {"info", "models", "health", "close"}
    assert VERBS["sample"].addressee == "sampler_id" and VERBS["forward_backward_many"].addressee == "run_ids"
    assert VERBS["free_run"].lifecycle == "free" and VERBS["create_sampler"].lifecycle == "create"
    # every command of the table is one the ranks execute, and nothing else but ping/shutdown
    assert set(OPS) == {v.command for v in VERBS.values() if v.command} | {"ping", "shutdown"}


def test_derived_methods_carry_the_protocol_signature_and_contract():
    assert inspect.signature(Recorder.forward_backward) == inspect.signature(Backend.forward_backward)
    assert Recorder.load_state.__doc__ == Backend.load_state.__doc__
    assert isinstance(Recorder(), Backend)


def test_derived_methods_bind_arguments_by_name_with_defaults():
    backend = Recorder()
    backend.create_run("r1", "m")
    backend.sample("s1", [], slice_s=0.5)
    backend.load_state("r1", path="/x", optimizer=False)
    assert backend.calls == [
        ("create_run", {"run_id": "r1", "base_model": "m", "lora": None}),
        ("sample", {"sampler_id": "s1", "requests": [], "job_id": None, "slice_s": 0.5}),
        ("load_state", {"run_id": "r1", "path": "/x", "optimizer": False}),
    ]
    with pytest.raises(TypeError):
        backend.optim_step("r1")  # adam missing: refused like a wrong call, before call_verb
    with pytest.raises(TypeError):
        backend.free_run("r1", extra=1)
    assert len(backend.calls) == 3


def test_a_method_defined_by_hand_is_kept_and_call_verb_is_required():
    class Proto:
        @verb("ping", addressee="run_id")
        def ping(self, run_id: str) -> str:
            """Ping a run."""
            ...

    table = verbs_of(Proto)

    @forward_verbs(table)
    class Own:
        def call_verb(self, one: Verb, arguments: dict[str, Any]) -> str:
            return "derived"

        def ping(self, run_id: str) -> str:
            return "own"

    assert Own().ping("r") == "own"
    with pytest.raises(TypeError, match="call_verb"):
        forward_verbs(table)(type("NoCallVerb", (), {}))


def test_observer_logs_each_worker_verb_and_records_training_metrics(tmp_path, caplog):
    def reply(one: Verb, arguments: dict[str, Any]) -> Any:
        if one.name == "forward_backward":
            return [], {"loss:sum": 1.5}
        if one.name == "optim_step":
            return {"step:max": 3.0}
        if one.name == "forward_backward_many":
            return [([], {"loss:sum": 2.0}), ValueError("its own error")]
        return None

    inner = Recorder(reply)
    observed = ObservedBackend(inner, tmp_path)
    with caplog.at_level(logging.INFO, logger="ringtune.ops"):
        assert observed.info() is INFO
        observed.forward_backward("r1", [], "cross_entropy", None, True)
        observed.optim_step("r1", AdamParams(learning_rate=1e-3))
        observed.forward_backward_many(["r1", "r2"], [[], []], "cross_entropy", None, False)
        observed.save_state("r2", "/ckpt/a")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("op=forward model=r1 ") and "loss_fn=cross_entropy" in lines[0]
    assert lines[1].startswith("op=optim_step model=r1 ")
    assert lines[2].startswith("op=forward_backward_many model=r1,r2 ") and "datums=0" in lines[2]
    assert lines[3].startswith("op=save_state model=r2 ") and "path=/ckpt/a" in lines[3]
    assert all(line.endswith(" ok") for line in lines) and len(lines) == 4  # info is not a worker verb
    rows = [json.loads(line) for line in (tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["op"], r.get("loss:sum"), r.get("step:max")) for r in rows] == [
        ("forward", 1.5, None),
        ("optim_step", None, 3.0),
        ("forward_backward", 2.0, None),
    ]
    assert not (tmp_path / "r2" / "metrics.jsonl").exists()  # r2's pass part was an error


def test_observer_logs_a_failed_verb_and_reraises(tmp_path, caplog):
    def reply(one: Verb, arguments: dict[str, Any]) -> Any:
        raise RuntimeError("boom")

    observed = ObservedBackend(Recorder(reply), tmp_path)
    with caplog.at_level(logging.INFO, logger="ringtune.ops"), pytest.raises(RuntimeError, match="boom"):
        observed.probe("ring_accumulation")
    assert caplog.records[-1].getMessage().endswith("error=RuntimeError")
