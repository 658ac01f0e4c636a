"""Self-healing of a one-machine ``ringtune serve``: rank 0 supervises the worker ranks it spawned.

:class:`SupervisedBackend` is the gateway's :class:`~ringtune.gateway.backend.Backend` in front of a
:class:`~ringtune.worker.backend.DistributedBackend`. It is a state machine with one lock (verbs and healing
never overlap)::

    SERVING --(a worker process exited / a command failed with a dead rank)--> FAILED
    FAILED      the command in flight fails with a RankFailedError (``category: server``) saying what happened
                and that the server is restarting; every worker process is SIGKILLed at once, so nothing
                waits on a peer that will never answer (never a hang)
    RESTARTING  leftovers joined, the default process group destroyed, a new world on a fresh port (a new
                store), new worker processes, a new mesh (:func:`ringtune.worker.launch.spawn_world`)
    RESTORING   every live run re-created and loaded from its newest checkpoint (the last save_state or
                load_state that succeeded: an autosave or a user save), or from the base model when it has
                none; sampling sessions rebuilt from their sources (a saved export, the base model, or a run's
                weights when that run lost nothing)
    SERVING     healthz answers 200 again; or BROKEN after ``max_restarts`` heals (healthz 503 for good)

Requests queued behind the failed one wait (up to ``heal_timeout_s``) and then run on the new world. The next
request of a run that lost optimizer steps or accumulated gradients fails once with a RankFailedError naming
the step its run was restored to (``category: server``); the one after works. A sampling session whose
weights could not be rebuilt fails once the same way and is then unknown.

What heals: the death of any worker rank (SIGKILL, OOM kill, a crash) on this machine. What does not: the
death of rank 0 itself (the gateway's process: restart the server; runs and checkpoints are on disk), and
any failure under torchrun, where torch's elastic agent (``--max-restarts``) restarts every rank instead.

The verbs are derived from the verb table (:data:`~ringtune.gateway.backend.VERBS`): each one runs through
:meth:`SupervisedBackend.call_verb`, which answers a pending notice, waits out a heal, and keeps the
:class:`~ringtune.worker.heal_ledger.HealLedger` of what a heal restores.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ringtune.errors import RankFailedError, UserInputError
from ringtune.gateway.backend import VERBS, BackendHealth, BackendInfo
from ringtune.gateway.verbs import Verb, forward_verbs
from ringtune.parallel import liveness, store_exchange
from ringtune.worker.backend import DistributedBackend
from ringtune.worker.heal_ledger import HealLedger

log = logging.getLogger(__name__)

SERVING, FAILED, RESTARTING, RESTORING, BROKEN, CLOSED = (
    "serving",
    "failed",
    "restarting",
    "restoring",
    "broken",
    "closed",
)
"""The supervisor's phases (module docstring)."""

RESTORED = "RestoredFromCheckpoint"
"""``error_type`` of the one-time error a run's next request gets after it lost steps in a heal."""


@dataclass
class HealReport:
    """One heal: its cause, when it was detected and when the server was healthy again (``time.monotonic``),
    the requests it failed, and per run the step it was at and the step it was restored to."""

    cause: str
    detected: float
    healthy: float | None = None
    failed_requests: int = 0
    runs: dict[str, tuple[int, int]] = field(default_factory=dict)
    samplers_lost: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        """Seconds from detection to healthy (None while healing or if it failed)."""
        return None if self.healthy is None else self.healthy - self.detected


def forget_world() -> None:
    """Forget this process's part in a torn-down world (the default process group must be destroyed first):
    liveness (identities, heartbeat, dead ranks) and the store exchanges' sequence numbers start over, so the
    next world lines up with the fresh worker processes (whose counters start at 0)."""
    liveness.leave()
    store_exchange.reset()


@forward_verbs(VERBS)
class SupervisedBackend:
    """Rank 0's backend that restarts dead worker ranks and restores the live runs (module docstring).

    Args:
        start: builds a fresh world and returns its backend (``spawn_world`` with the server's spec); called
            once here and once per heal, on a process without a default process group.
        max_restarts: heals allowed in the server's lifetime; after that a death leaves it broken (503).
        poll_s: how often the watcher thread looks at the worker processes.
        heal_timeout_s: how long a request queued behind a heal waits for it.
    """

    def __init__(
        self,
        start: Callable[[], DistributedBackend],
        *,
        max_restarts: int = 3,
        poll_s: float = 0.5,
        heal_timeout_s: float = 600.0,
    ) -> None:
        if max_restarts < 0:
            raise UserInputError(f"max_restarts={max_restarts} must be >= 0")
        self._start, self.max_restarts, self.poll_s, self.heal_timeout_s = start, max_restarts, poll_s, heal_timeout_s
        self.inner = start()
        self.phase = SERVING
        self.cause = ""
        self.ledger = HealLedger()
        self.runs, self.samplers = self.ledger.runs, self.ledger.samplers  # what _restore brings back
        self.notices: dict[str, str] = {}
        self.heals: list[HealReport] = []
        self._cond = threading.Condition(threading.RLock())
        self._watcher = threading.Thread(target=self._watch, name="ringtune-supervisor", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ health

    def info(self) -> BackendInfo:
        """The current world's description of the first served model."""
        return self.inner.info()

    def models(self) -> tuple[BackendInfo, ...]:
        """The current world's descriptions of every served model."""
        return self.inner.models()

    def health(self) -> BackendHealth:
        """The inner backend's health while serving; else not ok with the phase and its cause."""
        phase = self.phase
        extra: dict[str, float | str] = {"restarts": float(len(self.heals)), "phase": phase}
        if phase == SERVING:
            inner = self.inner.health()
            return BackendHealth(ok=inner.ok, detail=inner.detail, extra={**inner.extra, **extra})
        if phase in (BROKEN, CLOSED):
            return BackendHealth(ok=False, detail=f"the worker ranks cannot serve ({phase}): {self.cause}", extra=extra)
        detail = f"restarting the worker ranks ({phase}) after: {self.cause}"
        return BackendHealth(ok=False, detail=detail, extra=extra)

    def _dead_worker(self) -> str | None:
        """Why the current world cannot serve (a worker process exited, or the inner health says so), or None."""
        gone = [(p.name, p.pid, p.exitcode) for p in self.inner.workers if not p.is_alive()]
        if gone:
            return "; ".join(f"worker {name} (pid {pid}) exited with code {code}" for name, pid, code in gone)
        health = self.inner.health()
        return None if health.ok else health.detail

    def _watch(self) -> None:
        """Find a dead worker while no request is running (idle servers heal too)."""
        while self.phase != CLOSED:
            time.sleep(self.poll_s)
            world = self.inner
            if self.phase == SERVING:
                why = self._dead_worker()
                if why is not None:
                    self._fail(why, world)

    # ------------------------------------------------------------------ the state machine

    def _kill_workers(self) -> None:
        """SIGKILL every worker process still alive: any collective or wait rank 0 is in fails at once."""
        for p in self.inner.workers:
            if p.is_alive():
                p.kill()

    def _fail(self, cause: str, world: DistributedBackend) -> None:
        """SERVING -> FAILED for the world ``world``: kill its workers (before the lock: the command in flight
        must end), then heal; nothing if that world was already replaced (another thread found it first)."""
        if self.phase != SERVING or world is not self.inner:
            return
        self._kill_workers()
        with self._cond:
            if self.phase != SERVING or world is not self.inner:
                return
            log.error("supervisor: the mesh lost a rank (%s); restarting the worker ranks", cause)
            self.phase, self.cause = FAILED, cause
            self.heals.append(HealReport(cause=cause, detected=time.monotonic()))
            threading.Thread(target=self._heal, name="ringtune-heal", daemon=True).start()

    def _heal(self) -> None:
        with self._cond:
            report = self.heals[-1]
            if len(self.heals) > self.max_restarts:
                self.phase = BROKEN
                self.cause += f" (no restart left: --max-restarts {self.max_restarts} used)"
                log.error("supervisor: %s", self.cause)
                self._tear_down()
                self._cond.notify_all()
                return
            try:
                self.phase = RESTARTING
                self._tear_down()
                self.inner = self._start()
                self.phase = RESTORING
                log.warning(
                    "supervisor: new worker ranks up %.1f s after the failure; restoring %d run(s), %d sampler(s)",
                    time.monotonic() - report.detected,
                    len(self.runs),
                    len(self.samplers),
                )
                self._restore(report)
            except Exception as exc:  # the new world failed too: nothing left to try automatically
                log.exception("supervisor: the restart failed")
                self.phase, self.cause = BROKEN, f"{self.cause}; the restart failed: {type(exc).__name__}: {exc}"
                self._cond.notify_all()
                return
            self.phase, report.healthy = SERVING, time.monotonic()
            lost = {r: before - after for r, (before, after) in report.runs.items() if before != after}
            log.warning(
                "supervisor: healthy again %.1f s after %s; %d request(s) failed; runs restored %s (steps lost %s)",
                report.seconds,
                report.cause,
                report.failed_requests,
                {r: after for r, (_, after) in report.runs.items()},
                lost,
            )
            self._cond.notify_all()

    def _tear_down(self) -> None:
        """Kill and join every worker, drop rank 0's runs and samplers, destroy the default process group."""
        self._kill_workers()
        for p in self.inner.workers:
            p.join(timeout=30)
        self.inner.executor.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_world()
        gc.collect()

    def _restore(self, report: HealReport) -> None:
        """Every tracked run from its newest checkpoint, then every sampling session (module docstring)."""
        for run_id, track in self.runs.items():
            before, lost_grads = track.step, track.pending
            self.inner.create_run(run_id, track.base_model, track.lora)
            where = "the base model (it had no checkpoint)"
            if track.checkpoint is not None:
                try:
                    self.inner.load_state(run_id, track.checkpoint, track.optimizer)
                    where = f"checkpoint {track.checkpoint}"
                except UserInputError as exc:  # deleted or damaged since: fall back to the base model
                    log.error("supervisor: run %s: checkpoint %s did not load (%s)", run_id, track.checkpoint, exc)
                    track.checkpoint, track.checkpoint_step, track.optimizer = None, 0, True
            track.step, track.pending = track.checkpoint_step, False
            report.runs[run_id] = (before, track.step)
            if before != track.step or lost_grads:
                self.notices[run_id] = (
                    f"the server restarted its worker ranks after a rank died ({report.cause}); run {run_id} was "
                    f"restored to step {track.step} from {where}: {before - track.step} optimizer step(s)"
                    f"{' and the gradients accumulated since the last step' if lost_grads else ''} were lost. "
                    "This request was not executed; resend it (and the lost steps) to go on"
                )
        for sampler_id, (source, run_step) in list(self.samplers.items()):
            if source.run_id is not None:
                track = self.runs.get(source.run_id)
                if track is None or run_step != track.step:
                    self.samplers.pop(sampler_id)
                    report.samplers_lost.append(sampler_id)
                    self.notices[f"sampler:{sampler_id}"] = (
                        f"the server restarted its worker ranks after a rank died ({report.cause}); sampling "
                        f"session {sampler_id} held the in-memory weights of run {source.run_id} at step {run_step}, "
                        "which were not saved: create a new sampling client (save_weights_for_sampler)"
                    )
                    continue
            self.inner.create_sampler(sampler_id, source)

    def _call(self, key: str | None, fn: Callable[[], Any]) -> Any:
        """Run one verb on the current world (waiting out a heal); turn a dead rank into a heal."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.phase in (SERVING, BROKEN, CLOSED), self.heal_timeout_s):
                raise RankFailedError(f"the worker ranks are still restarting after {self.heal_timeout_s:.0f} s")
            if self.phase != SERVING:
                raise RankFailedError(f"{self.health().detail}; restart the server")
            notice = self.notices.pop(key, None) if key else None
            if notice is not None:
                raise RankFailedError(notice, error_type=RESTORED)
            try:
                return fn()
            except RankFailedError as exc:
                why = self._dead_worker() or (str(exc) if exc.error_type == "RankDied" else None)
                if why is None:
                    raise
                self._fail(why, self.inner)
                self.heals[-1].failed_requests += 1
                raise RankFailedError(
                    f"{exc}. The server is restarting its worker ranks and restores every live run from its newest "
                    "checkpoint; resend the request when /api/v1/healthz answers 200 again",
                    rank=exc.rank,
                    error_type=exc.error_type,
                ) from exc

    # ------------------------------------------------------------------ verbs

    def call_verb(self, one: Verb, arguments: dict[str, Any]) -> Any:
        """Verb ``one`` on the current world (:meth:`_call`), then what a heal needs to know of it (the runs'
        checkpoints and steps, the sampling sessions' sources). The run or session it addresses answers its
        pending notice instead of running, unless the verb creates or frees it (a free drops the notice)."""
        if one.command is None:
            raise TypeError(f"{one.name} is answered by the supervisor itself, not forwarded")
        if one.name == "forward_backward_many":  # per-run notices inside one shared pass
            return self._forward_backward_many(arguments)
        key = arguments.get(one.addressee) if one.addressee else None  # notices: run id, or "sampler:<id>"
        if key is not None and one.addressee == "sampler_id":
            key = f"sampler:{key}"
        if one.lifecycle == "free":
            self.notices.pop(key, None)
        result = self._call(None if one.lifecycle else key, lambda: getattr(self.inner, one.name)(**arguments))
        self.ledger.record(one.name, arguments, result)
        return result

    def _forward_backward_many(self, arguments: dict[str, Any]) -> list[Any]:
        """LoRA runs in one pass (:meth:`Backend.forward_backward_many`, its arguments by name); a restored run's
        pending notice is its own result (a RankFailedError), the other runs still share the pass."""
        run_ids, data = arguments["run_ids"], arguments["data"]
        with self._cond:
            noticed = {r: self.notices.pop(r) for r in run_ids if r in self.notices}
        out: list[Any] = [RankFailedError(noticed[r], error_type=RESTORED) if r in noticed else None for r in run_ids]
        keep = [i for i, r in enumerate(run_ids) if r not in noticed]
        if not keep:
            return out
        rest = arguments | {"run_ids": [run_ids[i] for i in keep], "data": [data[i] for i in keep]}
        results = self._call(None, lambda: self.inner.forward_backward_many(**rest))
        for i, result in zip(keep, results, strict=True):
            out[i] = result
            if not arguments["forward_only"] and not isinstance(result, Exception):
                self.ledger.gradients_pending(run_ids[i])
        return out

    def close(self) -> None:
        """Stop watching (workers that exit now are not deaths), then close the current world."""
        with self._cond:
            phase, self.phase = self.phase, CLOSED
            self._cond.notify_all()
        if phase in (BROKEN,):
            return
        self.inner.close()
