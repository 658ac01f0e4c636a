"""Automatic checkpoints of live training runs, so that a crash or a restart loses little.

``ringtune serve --autosave-every N`` saves a run after every N-th optimizer step, ``--autosave-minutes M``
after the first optimizer step that comes M minutes or more after the run's last save (any save: an autosave,
a user's ``save_state``, or its creation / load). An autosave is an ordinary training checkpoint (weights +
AdamW + step, verified and atomic) named ``weights/autosave-<step, 8 digits>``, with ``user_metadata``
``{"autosave": "true", "step": "<step>"}``: it is listed, loadable and restorable like any other. Only the
newest ``--autosave-keep`` autosaves of a run are kept; older ones are deleted after the new one is complete.
The prefix ``autosave-`` is reserved: a user's ``save_state`` with such a name is refused.

Autosaves run inside the optimizer step's job on the gateway's backend thread (after the step, before its
result is answered), so they are ordered with the run's other operations. A failed autosave is logged and
does not fail the step (the step did happen).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ringtune.errors import UserInputError
from ringtune.gateway.backend import Backend
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.paths import CheckpointPaths, dir_bytes
from ringtune.gateway.state import CheckpointRecord, RunRecord, now_utc

log = logging.getLogger(__name__)

PREFIX = "autosave-"
"""The reserved name prefix of automatic checkpoints."""


def autosave_name(step: int) -> str:
    """The checkpoint name of the autosave at optimizer step ``step``."""
    return f"{PREFIX}{step:08d}"


def check_user_name(field: str, name: str) -> str:
    """``name`` unless it starts with the reserved :data:`PREFIX` (UserInputError naming ``field``)."""
    if name.startswith(PREFIX):
        raise UserInputError(f"{field}={name!r}: names starting with {PREFIX!r} are reserved for automatic checkpoints")
    return name


Commit = Callable[[], None]


class Autosaver:
    """When to autosave a run and how (module docstring). ``last_save``: run id -> ``time.monotonic()`` of its
    last save; touched from the backend thread only."""

    def __init__(self, config: GatewayConfig, paths: CheckpointPaths, backend: Backend, save_record) -> None:
        self.every, self.minutes, self.keep = config.autosave_every, config.autosave_minutes, config.autosave_keep
        self.paths, self.backend, self._save_record = paths, backend, save_record
        self.last_save: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        """Whether any autosave is configured (``--autosave-every`` or ``--autosave-minutes`` > 0)."""
        return self.every > 0 or self.minutes > 0

    def saved(self, run_id: str) -> None:
        """The run was just saved, created or loaded: the minutes count from now."""
        self.last_save[run_id] = time.monotonic()

    def due(self, run_id: str, step: int) -> bool:
        """Whether the run, having just reached optimizer step ``step``, is to be autosaved now."""
        if self.every > 0 and step > 0 and step % self.every == 0:
            return True
        last = self.last_save.setdefault(run_id, time.monotonic())
        return self.minutes > 0 and time.monotonic() - last >= 60.0 * self.minutes

    def after_step(self, record: RunRecord, step: int) -> Commit | None:
        """Autosave ``record``'s run if due (on the backend thread); the commit that lists it (and forgets the
        pruned ones), or None. Never raises: a failure is logged."""
        if not self.enabled or not self.due(record.run_id, step):
            return None
        name = autosave_name(step)
        try:
            path = self.paths.checkpoint(record.run_id, "weights", name)
            self.backend.save_state(record.run_id, str(path))
        except Exception:
            log.exception("autosave of run %s at step %d failed", record.run_id, step)
            return None
        self.saved(record.run_id)
        when = now_utc()
        checkpoint = CheckpointRecord("weights", name, when, dir_bytes(path), {"autosave": "true", "step": str(step)})
        older = sorted(c.name for c in list(record.checkpoints.values()) if c.kind == "weights" and _is_auto(c, name))
        drop = older[: max(0, len(older) + 1 - self.keep)]
        for old in drop:
            try:
                self.paths.delete(record.run_id, "weights", old)
            except Exception:
                log.exception("autosave: deleting weights/%s of run %s failed", old, record.run_id)
        log.info("autosaved run %s at step %d as weights/%s (deleted %s)", record.run_id, step, name, drop or "none")

        def commit() -> None:
            for old in drop:
                record.checkpoints.pop(f"weights/{old}", None)
            record.checkpoints[checkpoint.checkpoint_id] = checkpoint
            self._save_record(record)

        return commit


def _is_auto(checkpoint: CheckpointRecord, new_name: str) -> bool:
    return checkpoint.name.startswith(PREFIX) and checkpoint.name != new_name
