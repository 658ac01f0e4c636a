"""Training runs coming into being: ``create_model`` and create-via-load (``load_weights`` with a session).

Both reserve ``<session>:train:<model_seq_id>`` at once (admission, :meth:`RunBook.reserve_run`) and create it on
the backend in a job queued under the new run's id (so its first ops wait for it); a create that fails leaves no
run behind (its request_id still answers resubmits). A resubmitted create gets the original request_id. Every
method runs on the event loop thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtune.gateway import translate
from ringtune.gateway.autosave import Autosaver
from ringtune.gateway.backend import Backend
from ringtune.gateway.dispatch import Commit, Dispatcher
from ringtune.gateway.futures import Outcome
from ringtune.gateway.refusal import RefusedError, refusing_bad_input
from ringtune.gateway.runs import RunBook
from ringtune.gateway.state import RunRecord
from ringtune.gateway.wire import CreateModelBody, LoadWeightsBody


class RunCreation:
    """``create_model`` and create-via-load over ``runs`` (lookups, admission), the ``backend`` that holds the
    weights, the ``dispatcher`` that queues the jobs, and ``autosave`` (a new run's autosave clock starts)."""

    def __init__(self, runs: RunBook, backend: Backend, dispatcher: Dispatcher, autosave: Autosaver) -> None:
        self.runs, self.backend, self.dispatcher, self.autosave = runs, backend, dispatcher, autosave

    def create_model(self, body: CreateModelBody) -> dict[str, Any]:
        """Run ``<session>:train:<model_seq_id>`` of ``base_model``: full fine-tuning (lora rank 0 or no
        lora_config) or a LoRA run (rank > 0) on the shared frozen base; ``{"request_id", "model_id"}``."""
        session = self.runs.session(body.session_id)
        with refusing_bad_input():
            lora = translate.lora_spec(body.lora_config.model_dump() if body.lora_config else None)
            translate.check_optimizer_config(body.optimizer_config)
            metadata = translate.metadata_strings("user_metadata", body.user_metadata)
        self.runs.check_base_model(body.base_model)
        run_id = f"{session.session_id}:train:{body.model_seq_id}"
        known = self._known(run_id, body.model_seq_id)
        if known is not None:
            return known
        record = self.runs.reserve_run(session, body.model_seq_id, body.base_model, metadata, lora)
        return self._submit(record, "create_model", {"model_id": run_id, "type": "create_model"})

    def create_via_load(self, body: LoadWeightsBody, origin: RunRecord, path: Path, optimizer: bool) -> dict[str, Any]:
        """A new run ``<body.session_id>:train:<body.model_seq_id>`` restored from checkpoint ``path`` of run
        ``origin`` (with its AdamW state if ``optimizer``); it holds what ``origin`` held (full weights or adapters
        of its LoRA spec). ``{"request_id", "model_id"}``."""
        session = self.runs.session(body.session_id or "")
        if not optimizer:
            with refusing_bad_input():
                translate.check_optimizer_config(body.optimizer_config)
        base_model = body.base_model or origin.base_model
        self.runs.check_base_model(base_model)
        run_id = f"{session.session_id}:train:{body.model_seq_id}"
        known = self._known(run_id, body.model_seq_id)
        if known is not None:
            return known
        with refusing_bad_input():
            metadata = translate.metadata_strings("user_metadata", body.user_metadata) or dict(origin.user_metadata)
        record = self.runs.reserve_run(session, int(body.model_seq_id or 0), base_model, metadata, origin.lora)
        result = {"path": body.path, "model_id": run_id, "type": "load_weights"}
        return self._submit(record, "load_weights", result, load=(str(path), optimizer))

    def _known(self, run_id: str, model_seq_id: int | None) -> dict[str, Any] | None:
        """The answer of a resubmitted create of ``run_id``, None for a new one; RefusedError 400 if the run
        exists already (created otherwise)."""
        if run_id in self.runs.creates:
            return {"request_id": self.runs.creates[run_id], "model_id": run_id}
        if run_id in self.runs.registry.runs:
            raise RefusedError(400, f"model_seq_id={model_seq_id}: run {run_id} exists already")
        return None

    def _submit(
        self, record: RunRecord, op: str, result: dict[str, Any], load: tuple[str, bool] | None = None
    ) -> dict[str, Any]:
        """Queue the job that creates ``record``'s run on the backend (then loads checkpoint ``load`` = (path,
        optimizer), freeing the run again if that fails); its future answers ``result``."""
        run_id = record.run_id
        request_id = self.dispatcher.futures.create(op)
        self.runs.creates[run_id] = request_id

        def job() -> tuple[Outcome, Commit | None]:
            try:
                self.backend.create_run(run_id, record.base_model, record.lora)
                if load is not None:
                    try:
                        self.backend.load_state(run_id, load[0], load[1])
                    except BaseException:
                        self.backend.free_run(run_id)
                        raise
                self.autosave.saved(run_id)
            except BaseException:
                self.dispatcher.loop_call(lambda: self.runs.forget_failed_create(record))
                raise
            return Outcome("json", result), lambda: self.runs.registry.save(record)

        self.dispatcher.dispatch(request_id, job, run_id)
        return {"request_id": request_id, "model_id": run_id}
