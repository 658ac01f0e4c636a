"""The Tinker verbs without HTTP: validation, per-run ordering, futures, errors.

Threading: every method runs on the event loop thread (state needs no locks). Backend calls run as jobs
on one worker thread (:class:`~ringtune.gateway.scheduler.FairExecutor`: a FIFO queue per training run, served
round-robin, so ops dispatched in ``seq_id`` order run in that order and one run's burst does not hold the
others back; sampling drains queue under ``"sampling"``); a job returns an :class:`Outcome` and,
optionally, a commit that updates the state on the loop thread once it is done.

Errors: a request the gateway cannot even address (undecodable body, unknown model/session/future, bad
seq_id) raises :class:`RefusedError` (a JSON 4xx). Anything wrong with a request's content is found inside
its job and fails its future with ``category: user`` (so its ``seq_id`` is consumed and later ops go on);
any other exception fails it with ``category: server``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable, Hashable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ringtune.errors import RankFailedError, UserInputError
from ringtune.gateway import proto, translate
from ringtune.gateway.autosave import Autosaver, check_user_name
from ringtune.gateway.backend import Backend
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.downloads import DownloadSigner
from ringtune.gateway.futures import FutureStore, Outcome
from ringtune.gateway.observe import ObservedBackend
from ringtune.gateway.passes import PassPart, pass_kind, run_pass
from ringtune.gateway.paths import CheckpointPaths, check_name, dir_bytes
from ringtune.gateway.restore import restore_live_runs
from ringtune.gateway.routing_records import RoutingRecords
from ringtune.gateway.run_memory import check_admission
from ringtune.gateway.sampling import CreateSamplingSessionBody, SamplingService, new_sampler_id
from ringtune.gateway.scheduler import DEFAULT_KEY, FairExecutor
from ringtune.gateway.state import CheckpointRecord, Registry, RunRecord, Session, now_utc
from ringtune.gateway.wire import (
    CreateModelBody,
    LoadWeightsBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
)
from ringtune.probes.ring_accumulation import SERVED_PROBES
from ringtune.sample.pool import SamplerSource

log = logging.getLogger(__name__)

Commit = Callable[[], None]
SHUTTING_DOWN = "the server is shutting down (SIGTERM/SIGINT); this request was not executed: resend it after a restart"
Job = Callable[[], tuple[Outcome, Commit | None]]
Joinable = tuple[Hashable, Any, Callable[[list[Any]], list[tuple[Outcome, Commit | None]]]]
"""(kind, item, runner) of a request that may share a backend call (FairExecutor.submit_joinable)."""


class RefusedError(Exception):
    """A request refused before it becomes a future: HTTP ``status`` with ``{"error", "category"}``."""

    def __init__(self, status: int, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.status, self.message, self.category = status, message, category


class GatewayService:
    """Sessions, training runs and their ops over a :class:`Backend`; see the module docstring."""

    def __init__(self, backend: Backend, config: GatewayConfig) -> None:
        config.validate()
        self.backend, self.config = ObservedBackend(backend, config.checkpoint_root), config
        self.paths = CheckpointPaths(config.checkpoint_root)
        self.registry = Registry(self.paths)
        self.autosave = Autosaver(config, self.paths, self.backend, self.registry.save)
        self.futures = FutureStore(
            max_done=config.max_done_futures,
            max_age_s=config.future_max_age_s,
            retrieved_keep_s=config.retrieved_keep_s,
        )
        self.executor = FairExecutor("ringtune-backend", max_join=config.lora_pass_runs)
        self.downloads = DownloadSigner()
        """Signs the download URLs of external weights (a new secret per server start)."""
        self.routing = RoutingRecords() if config.routing_replay else None
        """Sampled sequences' MoE routing, replayed for matching training datums (``--routing-replay``)."""
        self.sampling = SamplingService(
            self.backend,
            self.futures,
            submit=self.executor.submit_for,
            call_on_loop=self._loop_call,
            max_prompt_tokens=backend.info().context_length,
            slice_s=config.sample_slice_s,
            routing=self.routing,
        )
        self._creates: dict[str, str] = {}  # run_id -> request_id of its create_model / create-via-load
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        """Set by :meth:`drain`: jobs not started yet fail with ``category: server``."""
        self.notices: dict[str, str] = {}
        """run_id -> the ``category: server`` error its next op gets instead of running (a restored run)."""
        self.restored = restore_live_runs(self) if config.restore_live_runs else []
        if not config.restore_live_runs:
            self.registry.take_saved_sessions(restore=False)

    # ------------------------------------------------------------------ plumbing

    def _dispatch(self, request_id: str, job: Job, key: str = DEFAULT_KEY, join: Joinable | None = None) -> None:
        """Run ``job`` on the worker thread, queued under ``key`` (a run's id: its ops keep their order); resolve
        the future (and apply its commit) back on the loop. With ``join`` = (kind, item, runner) the request is
        queued as a joinable job instead (a LoRA pass, :mod:`ringtune.gateway.passes`; the runner never
        raises) and ``job`` is not used."""

        def guarded() -> tuple[Outcome, Commit | None]:
            try:
                return job()
            except UserInputError as exc:
                return Outcome.error(str(exc), "user"), None
            except RankFailedError as exc:  # a rank failed or died; the message says what happened and what next
                log.error("request %s failed: %s", request_id, exc)
                return Outcome.error(str(exc), "server"), None
            except Exception as exc:
                log.exception("request %s failed", request_id)
                return Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server"), None

        def done(fut: asyncio.Future) -> None:
            if fut.cancelled():  # still queued when the server began to shut down
                self.futures.resolve(request_id, Outcome.error(SHUTTING_DOWN, "server"))
                return
            outcome, commit = fut.result()
            if commit is not None and outcome.kind != "error":
                try:
                    commit()
                except Exception as exc:
                    log.exception("commit of %s failed", request_id)
                    outcome = Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server")
            self.futures.resolve(request_id, outcome)

        if self.stopping:
            self.futures.resolve(request_id, Outcome.error(SHUTTING_DOWN, "server"))
            return
        if join is not None:
            future = self.executor.submit_joinable(key, join[0], join[1], join[2])
        else:
            future = self.executor.submit_for(key, guarded)
        asyncio.wrap_future(future).add_done_callback(done)

    def _run(self, model_id: str, *, live: bool = True) -> RunRecord:
        record = self.registry.runs.get(model_id)
        if record is None:
            raise RefusedError(404, f"model_id={model_id!r}: no such training run")
        if live and not record.live:
            raise RefusedError(
                400, f"model_id={model_id!r} is not live (its session finished); load a checkpoint of it instead"
            )
        return record

    def _session(self, session_id: str) -> Session:
        session = self.registry.sessions.get(session_id)
        if session is None:
            raise RefusedError(404, f"session_id={session_id!r}: no such session (create_session first)")
        if session.finished:
            raise RefusedError(410, f"session_id={session_id!r} is finished ({session.finished})")
        return session

    def _ordered(
        self, record: RunRecord, seq_id: int | None, op: str, job: Job, join: Joinable | None = None
    ) -> dict[str, Any]:
        """Submit an op of ``record`` in ``seq_id`` order; a resubmit gets the original request_id."""
        try:
            seq = translate.check_seq_id(seq_id)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        known = record.gate.request_for(seq)
        if known is not None:
            return {"request_id": known, "model_id": record.run_id}
        request_id = self.futures.create(op)

        def dispatch() -> None:  # in seq_id order; the first op of a restored run gets its notice instead
            notice = self.notices.pop(record.run_id, None)
            if notice is not None:
                self.futures.resolve(request_id, Outcome.error(notice, "server"))
            else:
                self._dispatch(request_id, job, record.run_id, join)

        try:
            record.gate.add(seq, request_id, dispatch, self.futures.clock())
        except UserInputError as exc:
            self.futures.resolve(request_id, Outcome.error(str(exc), "user"))
            raise RefusedError(400, str(exc)) from None
        record.touch()
        return {"request_id": request_id, "model_id": record.run_id}

    def _check_base_model(self, base_model: str) -> None:
        info = self.backend.info()
        if base_model not in (info.model_name, *info.aliases):
            raise RefusedError(
                400, f"base_model={base_model!r} is not served here; this server trains {info.model_name!r}"
            )

    def _reserve_run(
        self,
        session: Session,
        model_seq_id: int,
        base_model: str,
        metadata: dict[str, str],
        lora: dict[str, Any] | None = None,
    ) -> RunRecord:
        if isinstance(model_seq_id, bool) or model_seq_id < 0:
            raise RefusedError(400, f"model_seq_id={model_seq_id!r} must be an integer >= 0")
        live = [r.lora for r in self.registry.live_runs()]
        try:  # memory, not a count: a LoRA run costs its adapters' state (gateway/run_memory.py)
            check_admission(self.backend.info(), live, lora, self.config.max_live_runs)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        run_id = f"{session.session_id}:train:{model_seq_id}"
        now = now_utc()
        record = RunRecord(run_id, base_model, session.session_id, metadata, now, now, live=True, lora=lora)
        self.registry.runs[run_id] = record
        session.runs.append(run_id)
        return record

    def _forget_failed_create(self, record: RunRecord) -> None:
        """A create (or create-via-load) failed: the run never existed (its request_id still answers resubmits)."""
        record.live, record.freed = False, True
        self.registry.runs.pop(record.run_id, None)

    # ------------------------------------------------------------------ sessions

    def create_session(self, user_metadata: dict[str, Any] | None, tags: list[str]) -> dict[str, Any]:
        session = self.registry.new_session(user_metadata, tags)
        return {"session_id": session.session_id, "type": "create_session"}

    def heartbeat(self, session_id: str) -> dict[str, Any]:
        self._session(session_id).last_heartbeat = self.futures.clock()
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
                    self._free(record, f"its session {session_id} finished ({reason})")
        return {"session_id": session_id, "status": "finished"}

    def _free(self, record: RunRecord, why: str) -> None:
        record.live, record.freed = False, True
        self.registry.save(record)  # not live any more: a restart does not bring it back
        for request_id in record.gate.cancel():
            self.futures.resolve(request_id, Outcome.error(f"model {record.run_id} was freed: {why}", "user"))
        ephemeral = self.paths.run_dir(record.run_id) / "ephemeral"

        def job() -> tuple[Outcome, Commit | None]:
            self.backend.free_run(record.run_id)
            shutil.rmtree(ephemeral, ignore_errors=True)
            return Outcome("json", {}), None

        self._dispatch(self.futures.create("free_run"), job, record.run_id)
        log.info("freed run %s: %s", record.run_id, why)

    def tick(self) -> None:
        """Housekeeping, once a second: drop old futures, skip stale seq gaps, expire silent sessions."""
        self.futures.prune()
        now = self.futures.clock()
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

    # ------------------------------------------------------------------ models

    def create_model(self, body: CreateModelBody) -> dict[str, Any]:
        """Run ``<session>:train:<model_seq_id>`` of ``base_model``: full fine-tuning (lora rank 0 or no
        lora_config) or a LoRA run (rank > 0) on the shared frozen base."""
        session = self._session(body.session_id)
        try:
            lora = translate.lora_spec(body.lora_config.model_dump() if body.lora_config else None)
            translate.check_optimizer_config(body.optimizer_config)
            metadata = translate.metadata_strings("user_metadata", body.user_metadata)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        self._check_base_model(body.base_model)
        run_id = f"{session.session_id}:train:{body.model_seq_id}"
        if run_id in self._creates:
            return {"request_id": self._creates[run_id], "model_id": run_id}
        if run_id in self.registry.runs:
            raise RefusedError(400, f"model_seq_id={body.model_seq_id}: run {run_id} exists already")
        record = self._reserve_run(session, body.model_seq_id, body.base_model, metadata, lora)
        request_id = self.futures.create("create_model")
        self._creates[run_id] = request_id

        def job() -> tuple[Outcome, Commit | None]:
            try:
                self.backend.create_run(run_id, record.base_model, record.lora)
                self.autosave.saved(run_id)
            except BaseException:
                self._loop_call(lambda: self._forget_failed_create(record))
                raise
            return Outcome("json", {"model_id": run_id, "type": "create_model"}), lambda: self.registry.save(record)

        self._dispatch(request_id, job, run_id)
        return {"request_id": request_id, "model_id": run_id}

    def _loop_call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop thread (from the worker thread)."""
        assert self._loop is not None, "bind_loop() was not called (the app's lifespan does it)"
        self._loop.call_soon_threadsafe(fn)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop this service lives on (for commits from the worker)."""
        self._loop = loop

    def get_info(self, model_id: str) -> dict[str, Any]:
        record = self._run(model_id, live=False)
        info = self.backend.info()
        model_data = {"arch": info.arch, "model_name": record.base_model}
        if info.tokenizer_dir:
            model_data["tokenizer_id"] = info.tokenizer_dir
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": model_data,
            "is_lora": record.lora is not None,
            "lora_rank": None if record.lora is None else record.lora["rank"],
            "model_name": record.base_model,
            "optimizer_config": {"type": "adamw"},
        }

    # ------------------------------------------------------------------ training ops

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        """Protobuf ``ForwardBackwardRequest`` (``forward_only`` for forward); result: protobuf output."""
        try:
            msg = proto.parse_request(body)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        record = self._run(msg.model_id)
        run_id, backend = record.run_id, self.backend

        def job() -> tuple[Outcome, Commit | None]:  # the request alone: a pass of one part
            return run_pass(backend, [PassPart(run_id, msg)], self.routing)[0]

        join = None
        kind = pass_kind(msg) if record.lora is not None and self.executor.max_join > 1 else None
        if kind is not None:  # a LoRA run: may share one pass over the base with other runs' waiting requests
            join = (kind, PassPart(run_id, msg), lambda parts: run_pass(backend, parts, self.routing))
        return self._ordered(record, msg.seq_id, "forward" if msg.forward_only else "forward_backward", job, join)

    def optim_step(self, body: OptimStepBody) -> dict[str, Any]:
        record = self._run(body.model_id)
        run_id = record.run_id

        def job() -> tuple[Outcome, Commit | None]:
            if body.adam_params is None and (body.optimizer_params or body.optim_params):
                other = body.optimizer_params or body.optim_params or {}
                raise UserInputError(
                    f"optimizer_params.type={other.get('type')!r}: only adam_params (AdamW) is supported"
                )
            adam = translate.adam_params(body.adam_params)
            metrics = self.backend.optim_step(run_id, adam)
            commit = self.autosave.after_step(record, int(metrics.get("step:max", 0)))
            return Outcome("json", {"metrics": {k: float(v) for k, v in metrics.items()}, "type": "optim_step"}), commit

        return self._ordered(record, body.seq_id, "optim_step", job)

    def _add_checkpoint(self, record: RunRecord, checkpoint: CheckpointRecord) -> Commit:
        def commit() -> None:
            record.checkpoints[checkpoint.checkpoint_id] = checkpoint
            self.registry.save(record)

        return commit

    def save_weights(self, body: SaveWeightsBody) -> dict[str, Any]:
        """``save_state``: weights + optimizer to ``<root>/<run>/weights/<name>``; result ``tinker://run/weights/name``."""
        record = self._run(body.model_id)
        run_id = record.run_id

        def job() -> tuple[Outcome, Commit | None]:
            name = check_user_name("path", check_name("path", body.path))
            ttl = translate.check_ttl(body.ttl_seconds)
            metadata = translate.metadata_strings("user_metadata", body.user_metadata)
            path = self.paths.checkpoint(run_id, "weights", name)
            if (path.exists() or path.is_symlink()) and not body.overwrite:
                raise UserInputError(
                    f"path={name!r}: checkpoint weights/{name} exists; pass overwrite=True to replace it"
                )
            self.backend.save_state(run_id, str(path))
            self.autosave.saved(run_id)
            when = now_utc()
            checkpoint = CheckpointRecord(
                "weights", name, when, dir_bytes(path), metadata, when + timedelta(seconds=ttl) if ttl else None
            )
            result = {"path": f"tinker://{run_id}/weights/{name}", "type": "save_weights"}
            return Outcome("json", result), self._add_checkpoint(record, checkpoint)

        return self._ordered(record, body.seq_id, "save_weights", job)

    def save_weights_for_sampler(self, body: SaveWeightsForSamplerBody) -> dict[str, Any]:
        """Named: HF export to ``<root>/<run>/sampler_weights/<name>``; ephemeral: an export behind a new
        ``sampling_session_id`` (the sampler that serves it is a later stage)."""
        record = self._run(body.model_id)
        run_id = record.run_id

        def job() -> tuple[Outcome, Commit | None]:
            if body.path is None:
                seq = body.sampling_session_seq_id
                if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                    raise UserInputError(
                        f"sampling_session_seq_id={seq!r}: an unnamed save_weights_for_sampler needs an integer >= 0"
                    )
                # An in-memory snapshot of the run's current weights (shared while they do not change).
                sampler_id = new_sampler_id(record.session_id, seq)
                self.sampling.register(sampler_id, record.base_model, None, SamplerSource(run_id=run_id))
                return Outcome("json", {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}), None
            name = check_name("path", body.path)
            ttl = translate.check_ttl(body.ttl_seconds)
            metadata = translate.metadata_strings("user_metadata", body.user_metadata)
            path = self.paths.checkpoint(run_id, "sampler_weights", name)
            self.backend.export_for_sampler(run_id, str(path))
            when = now_utc()
            checkpoint = CheckpointRecord(
                "sampler_weights", name, when, dir_bytes(path), metadata, when + timedelta(seconds=ttl) if ttl else None
            )
            result = {"path": f"tinker://{run_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
            return Outcome("json", result), self._add_checkpoint(record, checkpoint)

        return self._ordered(record, body.seq_id, "save_weights_for_sampler", job)

    def save_weights_external(self, body: SaveWeightsExternalBody) -> dict[str, Any]:
        """The run's weights as an HF checkpoint under ``<root>/<run>/external_weights/<name>`` (a LoRA run's with
        its PEFT adapter), for download through signed URLs (:mod:`ringtune.gateway.downloads`)."""
        record = self._run(body.model_id)
        run_id = record.run_id

        def job() -> tuple[Outcome, Commit | None]:
            name = check_name("path", body.path)
            ttl = translate.check_ttl(body.ttl_seconds)
            if body.age_encryption_recipients:
                raise UserInputError(
                    f"age_encryption_recipients={body.age_encryption_recipients!r}: encrypted exports are not "
                    "supported by this server; send none (downloads go over its own signed URLs)"
                )
            path = self.paths.checkpoint(run_id, "external_weights", name)
            if path.exists():
                raise UserInputError(f"path={name!r}: external_weights/{name} exists; choose another name")
            self.backend.export_for_sampler(run_id, str(path))
            when, size = now_utc(), dir_bytes(path)
            expires = when + timedelta(seconds=ttl) if ttl else None
            checkpoint = CheckpointRecord("external_weights", name, when, size, {}, expires)
            result = {"path": f"tinker://{run_id}/external_weights/{name}", "size_bytes": size}
            return Outcome("json", result | {"type": "save_weights_external"}), self._add_checkpoint(record, checkpoint)

        return self._ordered(record, body.seq_id, "save_weights_external", job)

    def load_weights(self, body: LoadWeightsBody) -> dict[str, Any]:
        """Create-via-load (``session_id`` + ``model_seq_id``: a new run ``<session>:train:<n>`` restored from
        ``path``) or legacy (``model_id`` + ``seq_id``: onto an existing run, in order)."""
        try:
            source = translate.parse_tinker_path("path", body.path, kinds=("weights",))
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        origin = self.registry.runs.get(source.run_id)
        if origin is None:
            raise RefusedError(404, f"path={body.path!r}: no training run {source.run_id!r} on this server")
        path = self.paths.checkpoint(source.run_id, "weights", source.name)
        optimizer = bool(body.optimizer)
        if body.session_id is not None and body.model_seq_id is not None:
            return self._create_via_load(body, origin, path, optimizer)
        if body.model_id is None:
            raise RefusedError(
                400, "load_weights needs session_id + model_seq_id (create-via-load) or model_id + seq_id"
            )
        record = self._run(body.model_id)

        def job() -> tuple[Outcome, Commit | None]:
            self.backend.load_state(record.run_id, str(path), optimizer)
            return Outcome("json", {"path": body.path, "model_id": record.run_id, "type": "load_weights"}), None

        return self._ordered(record, body.seq_id, "load_weights", job)

    def _create_via_load(self, body: LoadWeightsBody, origin: RunRecord, path: Path, optimizer: bool) -> dict[str, Any]:
        session = self._session(body.session_id or "")
        if not optimizer:
            try:
                translate.check_optimizer_config(body.optimizer_config)
            except UserInputError as exc:
                raise RefusedError(400, str(exc)) from None
        base_model = body.base_model or origin.base_model
        self._check_base_model(base_model)
        run_id = f"{session.session_id}:train:{body.model_seq_id}"
        if run_id in self._creates:
            return {"request_id": self._creates[run_id], "model_id": run_id}
        if run_id in self.registry.runs:
            raise RefusedError(400, f"model_seq_id={body.model_seq_id}: run {run_id} exists already")
        try:
            metadata = translate.metadata_strings("user_metadata", body.user_metadata) or dict(origin.user_metadata)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        # the checkpoint's run says what it holds: full weights or adapters of its spec
        record = self._reserve_run(session, int(body.model_seq_id or 0), base_model, metadata, origin.lora)
        request_id = self.futures.create("load_weights")
        self._creates[run_id] = request_id

        def job() -> tuple[Outcome, Commit | None]:
            try:
                self.backend.create_run(run_id, base_model, record.lora)
                try:
                    self.backend.load_state(run_id, str(path), optimizer)
                    self.autosave.saved(run_id)
                except BaseException:
                    self.backend.free_run(run_id)
                    raise
            except BaseException:
                self._loop_call(lambda: self._forget_failed_create(record))
                raise
            result = {"path": body.path, "model_id": run_id, "type": "load_weights"}
            return Outcome("json", result), lambda: self.registry.save(record)

        self._dispatch(request_id, job, run_id)
        return {"request_id": request_id, "model_id": run_id}

    # ------------------------------------------------------------------ futures

    async def probe(self, name: str) -> dict[str, Any]:
        """A served probe (:data:`~ringtune.probes.ring_accumulation.SERVED_PROBES`) on the backend's ranks, queued
        on the backend thread like any op; its summary. RefusedError 400 for an unknown name."""
        if name not in SERVED_PROBES:
            raise RefusedError(400, f"name={name!r} is not a served probe; choose one of {list(SERVED_PROBES)}")
        return await self._on_backend(lambda: self.backend.probe(name))

    async def create_sampling_session(self, body: CreateSamplingSessionBody) -> dict[str, Any]:
        """A sampling session on the base model or a ``tinker://<run>/sampler_weights/<name>`` export."""
        session = self._session(body.session_id)
        if (body.model_path is None) == (body.base_model is None):
            raise RefusedError(400, "create_sampling_session needs exactly one of model_path and base_model")
        if body.model_path is not None:
            try:
                source = translate.parse_tinker_path("model_path", body.model_path, kinds=("sampler_weights",))
            except UserInputError as exc:
                raise RefusedError(400, str(exc)) from None
            run_id, name = source.run_id, source.name
            origin = self._run(run_id, live=False)
            path = self.paths.checkpoint(run_id, "sampler_weights", name)
            if not (path / "config.json").is_file():
                raise RefusedError(404, f"model_path={body.model_path!r}: no such sampler checkpoint")
            base_model, where = origin.base_model, SamplerSource(path=str(path))
        else:
            self._check_base_model(body.base_model)
            base_model, where = body.base_model, SamplerSource()
        sampler_id = new_sampler_id(session.session_id, body.sampling_session_seq_id)
        await self._on_backend(lambda: self.sampling.register(sampler_id, base_model, body.model_path, where))
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def _on_backend(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the backend thread, awaited (a route that answers synchronously); while the server shuts
        down (SIGTERM drain) a JSON 503 ``category: server`` instead of running it."""
        if self.stopping:
            raise RefusedError(503, SHUTTING_DOWN, "server")
        try:
            future = self.executor.submit(fn)
        except RuntimeError:  # the backend thread was shut down meanwhile
            raise RefusedError(503, SHUTTING_DOWN, "server") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled():  # still queued when the drain began
                raise RefusedError(503, SHUTTING_DOWN, "server") from None
            raise

    async def retrieve(self, request_id: str) -> Outcome:
        """The outcome, or a ``try_again`` after the long-poll; RefusedError 404 for an unknown request_id."""
        try:
            outcome = await self.futures.wait(request_id, self.config.poll_timeout_s)
        except KeyError:
            raise RefusedError(
                404, f"request_id={request_id!r}: unknown (never issued, or dropped after retrieval / expiry)"
            ) from None
        if outcome is None:
            return Outcome("json", {"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return outcome

    def drain(self) -> None:
        """Shutdown, first part (any thread): queued and later jobs fail with ``category: server``; returns once
        the job running now has finished (its result stays retrievable)."""
        self.stopping = True
        self.executor.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker (after the queued jobs) and the backend."""
        self.executor.shutdown(wait=True)
        self.backend.close()
