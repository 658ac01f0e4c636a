"""Observability of the backend verbs: one log line per operation and a JSONL metrics file per training run.

:class:`ObservedBackend` wraps any :class:`~ringtune.gateway.backend.Backend`: every verb that runs on the workers
logs ``op=<verb> model=<run or session> <argument summary> seconds=<s> ok|error`` on the ``ringtune.ops`` logger
(the summary: ``datums`` / ``tokens`` of training data, ``requests`` / ``sequences`` of sampling requests, the
loss, path, job or probe name), and the metrics of ``forward_backward`` / ``forward`` / ``optim_step`` are
appended, one JSON object per line, to ``<checkpoint_root>/<run_id>/metrics.jsonl`` with the wall time and the op
(optim_step's metrics carry the trainer's ``step:max``). Its methods are derived from the verb table
(:data:`~ringtune.gateway.backend.VERBS`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ringtune.gateway.backend import VERBS, Backend
from ringtune.gateway.verbs import Verb, forward_verbs

log = logging.getLogger("ringtune.ops")

_NAMED = ("loss_fn", "path", "job_id", "name")
"""Arguments logged as they are."""


def datum_tokens(data: Sequence[Any]) -> int:
    """Tokens of the training datums ``data`` (a datum without a length counts 0)."""
    total = 0
    for d in data:
        try:
            total += len(d.tokens)
        except TypeError:
            pass
    return total


def argument_summary(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The log fields of a verb's ``arguments``: counts of its data and sampling requests, named values."""
    fields: dict[str, Any] = {}
    data = arguments.get("data")
    if data is not None:
        parts = data if "run_ids" in arguments else [data]  # forward_backward_many: one list per run
        fields |= {"datums": sum(len(p) for p in parts), "tokens": sum(datum_tokens(p) for p in parts)}
    requests = arguments.get("requests")
    if requests is not None:
        fields |= {"requests": len(requests), "sequences": sum(r.num_samples for r in requests)}
    return fields | {k: arguments[k] for k in _NAMED if arguments.get(k) is not None}


def op_name(one: Verb, arguments: Mapping[str, Any]) -> str:
    """The logged and recorded op: the verb's name, ``forward`` for a forward-only ``forward_backward``."""
    if arguments.get("forward_only"):
        return one.name.replace("forward_backward", "forward")
    return one.name


@forward_verbs(VERBS)
class ObservedBackend:
    """``backend`` with a log line per verb and per-run metrics files under ``root`` (see the module docstring)."""

    def __init__(self, backend: Backend, root: str | Path) -> None:
        self.backend, self.root = backend, Path(root)

    def call_verb(self, one: Verb, arguments: dict[str, Any]) -> Any:
        """``one`` on the wrapped backend; logged and its metrics recorded when it runs on the workers."""
        call = getattr(self.backend, one.name)
        if one.command is None:  # info, health, close: answered by the backend alone
            return call(**arguments)
        op = op_name(one, arguments)
        addressee = arguments.get(one.addressee) if one.addressee else None
        model = ",".join(addressee) if isinstance(addressee, list | tuple) else addressee
        start, status = time.perf_counter(), "ok"
        try:
            result = call(**arguments)
        except Exception as exc:
            status = f"error={type(exc).__name__}"
            raise
        finally:
            extra = " ".join(f"{k}={v}" for k, v in argument_summary(arguments).items())
            log.info("op=%s model=%s %s seconds=%.3f %s", op, model, extra, time.perf_counter() - start, status)
        if one.name in ("forward_backward", "optim_step"):
            self._record(arguments["run_id"], op, result if one.name == "optim_step" else result[1])
        elif one.name == "forward_backward_many":
            for run_id, outcome in zip(arguments["run_ids"], result, strict=True):
                if not isinstance(outcome, Exception):  # a run's own error (user, or a restored run's notice)
                    self._record(run_id, op.removesuffix("_many"), outcome[1])
        return result

    def _record(self, run_id: str, op: str, metrics: Mapping[str, float]) -> None:
        path = self.root / run_id / "metrics.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            line = {"time": time.time(), "op": op, **metrics}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:  # metrics are best effort: never fail a training op over them
            log.warning("metrics file %s not written: %s", path, exc)
