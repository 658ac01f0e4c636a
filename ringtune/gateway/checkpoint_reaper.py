"""The reaper: deletes checkpoints whose TTL ran out, never one that is in use.

A checkpoint expires at its ``expires_at`` (``ttl_seconds`` of the save, ``copy_weights`` or ``PUT .../ttl``;
:mod:`ringtune.gateway.checkpoint_admin`). Every ``GatewayConfig.reap_every_s`` seconds the gateway's ticker asks
:meth:`CheckpointReaper.due` for the expired checkpoints that are not in use, drops them from their runs' records
(on the event loop thread: from then on no request can name them) and deletes their files off the loop.

In use, and so kept past its expiry until it no longer is:

- a checkpoint a live sampling session samples from (its ``model_path``: a ``sampler_weights`` export, or a
  ``weights`` checkpoint through its export): the sampler reloads it from disk when its snapshot is evicted;
- the newest ``weights`` checkpoint of a live run: the state a restart brings the run back to
  (:mod:`ringtune.gateway.restore`).

Expiry is checked against the wall clock (``expires_at`` is UTC); a server that was down when a checkpoint expired
deletes it at its first pass after the start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import datetime

from ringtune.errors import UserInputError
from ringtune.gateway import translate
from ringtune.gateway.paths import CheckpointPaths
from ringtune.gateway.state import CheckpointRecord, Registry, RunRecord, now_utc

log = logging.getLogger(__name__)


class CheckpointReaper:
    """Expired checkpoints of ``registry``'s runs, minus those in use (module docstring).

    Args:
        registry: the run records (their ``checkpoints`` and ``live``).
        paths: the checkpoint root.
        sampler_paths: the ``model_path`` of every live sampling session (tinker paths, or None).
        clock: UTC now (tests move it).
        every_s: seconds between two passes (:meth:`pass_due`).
    """

    def __init__(
        self,
        registry: Registry,
        paths: CheckpointPaths,
        sampler_paths: Callable[[], Iterable[str | None]],
        *,
        clock: Callable[[], datetime] = now_utc,
        every_s: float = 30.0,
    ) -> None:
        self.registry, self.paths, self.sampler_paths = registry, paths, sampler_paths
        self.clock, self.every_s, self.last_pass = clock, every_s, -float("inf")

    def in_use(self) -> set[tuple[str, str]]:
        """``(run_id, checkpoint_id)`` of every checkpoint a live sampler or a live run uses."""
        used = set()
        for path in self.sampler_paths():
            try:
                parsed = translate.parse_tinker_path("model_path", path)
            except UserInputError:  # a base-model session (None) or a path that was never a checkpoint
                continue
            used.add((parsed.run_id, parsed.checkpoint_id))
        for record in self.registry.live_runs():
            newest = record.last("weights")
            if newest is not None:
                used.add((record.run_id, newest.checkpoint_id))
        return used

    def due(self) -> list[tuple[RunRecord, CheckpointRecord]]:
        """Loop thread: the expired checkpoints not in use, each dropped from its run's record (saved) now."""
        now, used = self.clock(), self.in_use()
        out = []
        for record in list(self.registry.runs.values()):
            expired = [
                c
                for c in record.checkpoints.values()
                if c.expires_at is not None and c.expires_at <= now and (record.run_id, c.checkpoint_id) not in used
            ]
            for checkpoint in expired:
                del record.checkpoints[checkpoint.checkpoint_id]
                out.append((record, checkpoint))
            if expired:
                self.registry.save(record)
        return out

    def delete(self, expired: list[tuple[RunRecord, CheckpointRecord]]) -> None:
        """Any thread: delete the files of :meth:`due`'s checkpoints (a failure is logged, the next start's
        reconciliation does not list a half-deleted checkpoint)."""
        for record, checkpoint in expired:
            try:
                self.paths.delete(record.run_id, checkpoint.kind, checkpoint.name)
                log.info("checkpoint %s of run %s expired; deleted", checkpoint.checkpoint_id, record.run_id)
            except Exception:
                log.exception("deleting expired %s of run %s failed", checkpoint.checkpoint_id, record.run_id)

    def pass_due(self) -> bool:
        """Whether ``every_s`` passed since the last pass (and start one now if so)."""
        now = time.monotonic()
        if now - self.last_pass < self.every_s:
            return False
        self.last_pass = now
        return True
