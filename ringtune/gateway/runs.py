"""Sessions and training runs: lookup, admission, the end of a session, freeing runs, housekeeping.

Every method runs on the event loop thread. A lookup of something the request cannot address (unknown or finished
session, unknown or freed run, a base model not served here, a run memory does not admit) raises
:class:`~ringtune.gateway.refusal.RefusedError` before any future exists.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway.backend import Backend, BackendInfo, served_info
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.dispatch import Commit, Dispatcher
from ringtune.gateway.futures import Outcome
from ringtune.gateway.paths import CheckpointPaths
from ringtune.gateway.refusal import RefusedError, refusing_bad_input
from ringtune.gateway.run_memory import check_admission
from ringtune.gateway.sampling import SamplingService
from ringtune.gateway.state import Registry, RunRecord, Session, now_utc
from ringtune.gateway.tokenizer_id import remote_tokenizer_id

log = logging.getLogger(__name__)


class RunBook:
    """The sessions and training runs the gateway knows (its :class:`Registry`) and their life cycle.

    Args:
        config: the gateway's settings (``max_live_runs``, ``gap_timeout_s``, ``session_timeout_s``).
        backend: the backend whose models are served (its ``models``; runs are freed on it).
        registry: sessions and run records (saved under the checkpoint root).
        paths: the checkpoint root (a freed run's ephemeral exports are deleted).
        dispatcher: runs the jobs that free runs; resolves the futures of ops a free cancels.
        sampling: the sampling sessions (a finished session's end too).

    Attributes:
        creates: run id -> request_id of its ``create_model`` or create-via-load (a resubmit gets it again).
    """

    def __init__(
        self,
        config: GatewayConfig,
        backend: Backend,
        registry: Registry,
        paths: CheckpointPaths,
        dispatcher: Dispatcher,
        sampling: SamplingService,
    ) -> None:
        self.config, self.backend, self.registry, self.paths = config, backend, registry, paths
        self.dispatcher, self.sampling = dispatcher, sampling
        self.creates: dict[str, str] = {}

    # ------------------------------------------------------------------ lookups

    def run(self, model_id: str, *, live: bool = True) -> RunRecord:
        """The record of run ``model_id``; RefusedError 404 if unknown, 400 if ``live`` and it is not live."""
        record = self.registry.runs.get(model_id)
        if record is None:
            raise RefusedError(404, f"model_id={model_id!r}: no such training run")
        if live and not record.live:
            raise RefusedError(
                400, f"model_id={model_id!r} is not live (its session finished); load a checkpoint of it instead"
            )
        return record

    def session(self, session_id: str) -> Session:
        """The open session ``session_id``; RefusedError 404 if unknown, 410 if finished."""
        session = self.registry.sessions.get(session_id)
        if session is None:
            raise RefusedError(404, f"session_id={session_id!r}: no such session (create_session first)")
        if session.finished:
            raise RefusedError(410, f"session_id={session_id!r} is finished ({session.finished})")
        return session

    def check_base_model(self, base_model: str) -> BackendInfo:
        """The served model ``base_model`` names (its name or an alias; :meth:`Backend.models`); RefusedError 400
        naming the served models otherwise."""
        try:
            return served_info(self.backend.models(), base_model)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None

    def model_of(self, record: RunRecord) -> BackendInfo:
        """The served model of run ``record`` (a run of a model no longer served reports the first one's)."""
        try:
            return served_info(self.backend.models(), record.base_model)
        except UserInputError:
            return self.backend.info()

    # ------------------------------------------------------------------ runs

    def reserve_run(
        self,
        session: Session,
        model_seq_id: int,
        base_model: str,
        metadata: dict[str, str],
        lora: dict[str, Any] | None = None,
    ) -> RunRecord:
        """Record run ``<session>:train:<model_seq_id>`` of served model ``base_model`` as live in ``session`` if
        that model's memory budget admits it (its live runs against ``config.live_runs_of`` it; a LoRA run costs its
        adapters' state, :mod:`ringtune.gateway.run_memory`); nothing on the backend yet. RefusedError 400 for a bad
        ``model_seq_id``, a base model not served, or a run memory does not admit."""
        if isinstance(model_seq_id, bool) or model_seq_id < 0:
            raise RefusedError(400, f"model_seq_id={model_seq_id!r} must be an integer >= 0")
        self.admit(base_model, lora)
        run_id = f"{session.session_id}:train:{model_seq_id}"
        now = now_utc()
        record = RunRecord(run_id, base_model, session.session_id, metadata, now, now, live=True, lora=lora)
        self.registry.runs[run_id] = record
        session.runs.append(run_id)
        return record

    def admit(self, base_model: str, lora: dict[str, Any] | None) -> BackendInfo:
        """The served model ``base_model`` names, if its memory budget admits one more run (``lora``: its LoRA spec,
        None: full fine-tuning) beside that model's live runs (``config.live_runs_of`` it; a LoRA run costs its
        adapters' state, :mod:`ringtune.gateway.run_memory`). RefusedError 400 for a base model not served or a
        run memory does not admit."""
        info = self.check_base_model(base_model)
        live = [r.lora for r in self.registry.live_runs() if self.model_of(r).model_name == info.model_name]
        with refusing_bad_input():
            check_admission(info, live, lora, self.config.live_runs_of(info.model_name))
        return info

    def forget_failed_create(self, record: RunRecord) -> None:
        """A create (or create-via-load) failed: the run never existed (its request_id still answers resubmits)."""
        record.live, record.freed = False, True
        self.registry.runs.pop(record.run_id, None)

    def free(self, record: RunRecord, why: str) -> None:
        """Free ``record``'s run: not live (saved so, a restart does not bring it back), its waiting ops fail with
        ``category: user`` naming ``why``, and a job drops it from the backend and deletes its ephemeral exports."""
        record.live, record.freed = False, True
        self.registry.save(record)
        for request_id in record.gate.cancel():
            self.dispatcher.futures.resolve(
                request_id, Outcome.error(f"model {record.run_id} was freed: {why}", "user")
            )
        ephemeral = self.paths.run_dir(record.run_id) / "ephemeral"

        def job() -> tuple[Outcome, Commit | None]:
            self.backend.free_run(record.run_id)
            shutil.rmtree(ephemeral, ignore_errors=True)
            return Outcome("json", {}), None

        self.dispatcher.dispatch(self.dispatcher.futures.create("free_run"), job, record.run_id)
        log.info("freed run %s: %s", record.run_id, why)

    def get_info(self, model_id: str) -> dict[str, Any]:
        """``get_info`` of run ``model_id`` (live or not): the served model's data, LoRA rank, optimizer.
        ``model_data.tokenizer_id`` is one a remote client can load (:mod:`ringtune.gateway.tokenizer_id`)."""
        record = self.run(model_id, live=False)
        info = self.model_of(record)
        model_data = {"arch": info.arch, "model_name": record.base_model}
        first = info.model_name == self.backend.info().model_name  # --tokenizer-id is the first model's, as --tokenizer
        tokenizer_id = remote_tokenizer_id(self.config.tokenizer_id if first else None, info.tokenizer_dir)
        if tokenizer_id:
            model_data["tokenizer_id"] = tokenizer_id
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": model_data,
            "is_lora": record.lora is not None,
            "lora_rank": None if record.lora is None else record.lora["rank"],
            "model_name": record.base_model,
            "optimizer_config": {"type": "adamw"},
        }

    # ------------------------------------------------------------------ sessions

    def create_session(self, user_metadata: dict[str, Any] | None, tags: list[str]) -> dict[str, Any]:
        """A new session; ``{"session_id", "type"}``."""
        session = self.registry.new_session(user_metadata, tags)
        return {"session_id": session.session_id, "type": "create_session"}

    def heartbeat(self, session_id: str) -> dict[str, Any]:
        """The session is alive now (its expiry clock restarts)."""
        self.session(session_id).last_heartbeat = self.dispatcher.futures.clock()
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, reason: str) -> dict[str, Any]:
        """End a session and free its live runs and its sampling sessions (records and checkpoints stay)."""
        session = self.registry.sessions.get(session_id)
        if session is None:
            raise RefusedError(404, f"session_id={session_id!r}: no such session")
        if not session.finished:
            session.finished = reason
            self.registry.finished(session)
            self.sampling.end_session(session_id)
            for run_id in session.runs:
                record = self.registry.runs.get(run_id)
                if record is not None and record.live:
                    self.free(record, f"its session {session_id} finished ({reason})")
        return {"session_id": session_id, "status": "finished"}

    def tick(self) -> None:
        """Housekeeping, once a second: drop old futures, skip stale seq gaps, expire silent sessions."""
        futures = self.dispatcher.futures
        futures.prune()
        now = futures.clock()
        for record in self.registry.live_runs():
            skipped = record.gate.skip_stale_gap(now, self.config.gap_timeout_s)
            if skipped:
                log.warning(
                    "run %s: skipped missing seq_ids %s after %.0f s", record.run_id, skipped, self.config.gap_timeout_s
                )
        if self.config.session_timeout_s > 0:
            for session in list(self.registry.sessions.values()):
                if not session.finished and now - session.last_heartbeat > self.config.session_timeout_s:
                    self.finish_session(session.session_id, "expired")
