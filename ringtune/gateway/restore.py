"""Live runs brought back after a restart of the whole server (``--restore-live-runs``; every torchrun restart).

On one machine a dead worker rank is healed by rank 0 (:mod:`ringtune.worker.supervisor`) and the live runs
never leave the gateway's memory. When the whole server restarts (torchrun's elastic agent restarts every rank
after any rank failed; or a person or a service manager restarts ``ringtune serve``), the gateway's memory is
gone, but the checkpoint root holds each run's record (with whether it was live) and each open session
(:mod:`ringtune.gateway.state`). At start-up, before serving, :func:`restore_live_runs`:

- opens every session the previous server left open again, under its id (the SDK clients' heartbeats and
  requests go on; the heartbeat clock starts now, so a client that is gone expires as usual);
- re-creates each run that was live in such a session on the backend and loads its newest ``weights``
  checkpoint (a save or an autosave: ``--autosave-every``) with the optimizer state; a run without one
  starts from the base model;
- answers the first request of each restored run (in ``seq_id`` order; the run's ordering gate starts at
  whichever ``seq_id`` arrives first) with a ``category: server`` error naming the step it was restored to
  and what was lost; the next requests run.

Not restored: sampling sessions (their snapshots were in memory; a request on one fails and the client
creates a new one), futures that were in flight (unknown ``request_id`` afterwards), runs whose session had
finished. A run whose re-creation fails (e.g. memory) stays listed but not live, and its requests say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ringtune.engine.checkpoint_layout import checkpoint_step
from ringtune.errors import UserInputError
from ringtune.gateway.backend import Backend
from ringtune.gateway.futures import SeqGate
from ringtune.gateway.paths import CheckpointPaths
from ringtune.gateway.state import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredRun:
    """One run brought back: its id, the step it resumes from, where that state came from, and the notice
    (a ``category: server`` error message) its first request gets instead of running."""

    run_id: str
    step: int
    source: str

    @property
    def notice(self) -> str:
        """What the run's first request after the restart answers (module docstring)."""
        return (
            f"the server restarted; run {self.run_id} was restored to step {self.step} from {self.source}: the "
            "optimizer steps after it and the gradients accumulated since were lost. This request was not executed; "
            "resend it (and the lost steps) to go on"
        )


def restore_live_runs(registry: Registry, backend: Backend, paths: CheckpointPaths) -> list[RestoredRun]:
    """Open ``registry``'s saved sessions again and re-create their live runs on ``backend`` from their newest
    checkpoint under ``paths`` (module docstring); the runs restored. The caller applies the rest: each run's
    first request answers :attr:`RestoredRun.notice`, and its autosave clock starts now.

    Changes ``registry`` (sessions open again, the runs live with a fresh ordering gate, their records saved).
    Runs on the constructing thread, before the gateway serves (nothing else uses the backend yet)."""
    sessions = {s.session_id: s for s in registry.take_saved_sessions(restore=True)}
    restored = []
    for record in sorted(registry.runs.values(), key=lambda r: r.run_id):
        session = sessions.get(record.session_id)
        if not record.was_live or session is None:
            continue
        try:
            backend.create_run(record.run_id, record.base_model, record.lora)
        except Exception as exc:  # listed, not live: its requests say so (load a checkpoint instead)
            log.error("restore: run %s was not re-created: %s", record.run_id, exc)
            continue
        step, source = 0, "the base model (it had no training checkpoint)"
        checkpoint = record.last("weights")
        if checkpoint is not None:
            path = paths.checkpoint(record.run_id, "weights", checkpoint.name)
            try:
                backend.load_state(record.run_id, str(path), True)
                step, source = checkpoint_step(path), f"checkpoint {checkpoint.checkpoint_id}"
            except (UserInputError, OSError, ValueError, KeyError) as exc:
                log.error("restore: run %s: %s did not load (%s); base model", record.run_id, path, exc)
        record.live, record.freed, record.gate = True, False, SeqGate(first=None)
        session.runs.append(record.run_id)
        registry.save(record)
        restored.append(RestoredRun(record.run_id, step, source))
        log.warning("restore: run %s live again at step %d from %s", record.run_id, step, source)
    return restored
