"""The Tinker verbs that write or read a run's checkpoint files: ``save_weights``, ``save_weights_for_sampler``,
``save_weights_external`` and ``load_weights``.

Checkpoints live under the checkpoint root (:class:`~ringtune.gateway.paths.CheckpointPaths`):
``<root>/<run>/weights/<name>`` (training state: weights, AdamW, step), ``sampler_weights/<name>`` (an HF export
for sampling) and ``external_weights/<name>`` (an HF export, a LoRA run's with its PEFT adapter, downloaded through
signed URLs: :mod:`ringtune.gateway.downloads`). Each verb is an op of its run, in ``seq_id`` order; a checkpoint
is listed in the run's record once its job succeeded. Every method runs on the event loop thread.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway import translate
from ringtune.gateway.autosave import Autosaver, check_user_name
from ringtune.gateway.backend import Backend
from ringtune.gateway.dispatch import Commit, Dispatcher
from ringtune.gateway.futures import Outcome
from ringtune.gateway.paths import CheckpointPaths, check_name, dir_bytes
from ringtune.gateway.refusal import RefusedError, refusing_bad_input
from ringtune.gateway.run_creation import RunCreation
from ringtune.gateway.runs import RunBook
from ringtune.gateway.sampling import SamplingService, new_sampler_id
from ringtune.gateway.state import CheckpointRecord, RunRecord, now_utc
from ringtune.gateway.wire import LoadWeightsBody, SaveWeightsBody, SaveWeightsExternalBody, SaveWeightsForSamplerBody
from ringtune.sample.pool import SamplerSource

SAMPLER_KINDS = ("snapshot", "inflight")
"""``save_weights_for_sampler``'s ``kind`` values (the SDK's ``SamplingClientKind``)."""


class CheckpointOps:
    """The checkpoint verbs over ``runs`` (lookups), ``backend``, ``paths`` (the checkpoint root), ``dispatcher``
    (per-run order), ``autosave`` (a save restarts its clock), ``sampling`` (an unnamed sampler export is a
    sampling session) and ``creation`` (``load_weights`` into a new run)."""

    def __init__(
        self,
        runs: RunBook,
        backend: Backend,
        paths: CheckpointPaths,
        dispatcher: Dispatcher,
        autosave: Autosaver,
        sampling: SamplingService,
        creation: RunCreation,
    ) -> None:
        self.runs, self.backend, self.paths, self.dispatcher = runs, backend, paths, dispatcher
        self.autosave, self.sampling, self.creation = autosave, sampling, creation

    def save_weights(self, body: SaveWeightsBody) -> dict[str, Any]:
        """``save_state``: weights + optimizer to ``<root>/<run>/weights/<name>``; result ``tinker://run/weights/name``."""
        record = self.runs.run(body.model_id)
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
            result = {"path": f"tinker://{run_id}/weights/{name}", "type": "save_weights"}
            return Outcome("json", result), self._listed(record, "weights", name, path, metadata, ttl)

        return self.dispatcher.ordered(record, body.seq_id, "save_weights", job)

    def save_weights_for_sampler(self, body: SaveWeightsForSamplerBody) -> dict[str, Any]:
        """Named: HF export to ``<root>/<run>/sampler_weights/<name>``; unnamed: a sampling session behind a new
        ``sampling_session_id`` on an in-memory snapshot of the run's current weights (``kind="snapshot"``) or on
        the run's shared inflight target, which this save republishes (``kind="inflight"``: every inflight
        session of the run, earlier ones too, then samples the newest published weights;
        :mod:`ringtune.sample.pool`). A named save is a snapshot: ``kind="inflight"`` with a path is a user error."""
        record = self.runs.run(body.model_id)
        run_id = record.run_id
        if body.kind not in SAMPLER_KINDS:
            raise RefusedError(400, f"kind={body.kind!r} is not one of {list(SAMPLER_KINDS)}")
        if body.kind == "inflight" and body.path is not None:
            raise RefusedError(
                400,
                f"kind='inflight' with path={body.path!r}: an inflight save publishes the run's weights to its "
                "inflight sampling sessions and has no name; send no path, or kind='snapshot' for a named export",
            )

        def job() -> tuple[Outcome, Commit | None]:
            if body.path is None:
                seq = body.sampling_session_seq_id
                if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                    raise UserInputError(
                        f"sampling_session_seq_id={seq!r}: an unnamed save_weights_for_sampler needs an integer >= 0"
                    )
                # An in-memory snapshot of the run's current weights (shared while they do not change), or the
                # run's inflight target republished with them.
                sampler_id = new_sampler_id(record.session_id, seq)
                model = self.runs.model_of(record).model_name  # which engine set samples it (--sampler vllm)
                source = SamplerSource(run_id=run_id, inflight=body.kind == "inflight", model=model)
                self.sampling.register(sampler_id, record.base_model, None, source)
                return Outcome("json", {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}), None
            name = check_name("path", body.path)
            ttl = translate.check_ttl(body.ttl_seconds)
            metadata = translate.metadata_strings("user_metadata", body.user_metadata)
            path = self.paths.checkpoint(run_id, "sampler_weights", name)
            self.backend.export_for_sampler(run_id, str(path))
            result = {"path": f"tinker://{run_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
            return Outcome("json", result), self._listed(record, "sampler_weights", name, path, metadata, ttl)

        return self.dispatcher.ordered(record, body.seq_id, "save_weights_for_sampler", job)

    def save_weights_external(self, body: SaveWeightsExternalBody) -> dict[str, Any]:
        """The run's weights as an HF checkpoint under ``<root>/<run>/external_weights/<name>`` (a LoRA run's with
        its PEFT adapter), for download through signed URLs (:mod:`ringtune.gateway.downloads`)."""
        record = self.runs.run(body.model_id)
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
            commit = self._listed(record, "external_weights", name, path, {}, ttl)
            result = {"path": f"tinker://{run_id}/external_weights/{name}", "size_bytes": dir_bytes(path)}
            return Outcome("json", result | {"type": "save_weights_external"}), commit

        return self.dispatcher.ordered(record, body.seq_id, "save_weights_external", job)

    def load_weights(self, body: LoadWeightsBody) -> dict[str, Any]:
        """Create-via-load (``session_id`` + ``model_seq_id``: a new run ``<session>:train:<n>`` restored from
        ``path``, :meth:`RunCreation.create_via_load`) or legacy (``model_id`` + ``seq_id``: onto an existing run, in
        order). RefusedError 400 for a malformed path or neither form, 404 for an unknown source run."""
        with refusing_bad_input():
            source = translate.parse_tinker_path("path", body.path, kinds=("weights",))
        origin = self.runs.registry.runs.get(source.run_id)
        if origin is None:
            raise RefusedError(404, f"path={body.path!r}: no training run {source.run_id!r} on this server")
        path = self.paths.checkpoint(source.run_id, "weights", source.name)
        optimizer = bool(body.optimizer)
        if body.session_id is not None and body.model_seq_id is not None:
            return self.creation.create_via_load(body, origin, path, optimizer)
        if body.model_id is None:
            raise RefusedError(
                400, "load_weights needs session_id + model_seq_id (create-via-load) or model_id + seq_id"
            )
        record = self.runs.run(body.model_id)

        def job() -> tuple[Outcome, Commit | None]:
            self.backend.load_state(record.run_id, str(path), optimizer)
            return Outcome("json", {"path": body.path, "model_id": record.run_id, "type": "load_weights"}), None

        return self.dispatcher.ordered(record, body.seq_id, "load_weights", job)

    def _listed(
        self, record: RunRecord, kind: str, name: str, path: Path, metadata: dict[str, str], ttl: int | None
    ) -> Commit:
        """The commit that lists checkpoint ``kind/name`` (written at ``path`` now, expiring after ``ttl``
        seconds if set) in ``record`` and saves the record."""
        when = now_utc()
        expires = when + timedelta(seconds=ttl) if ttl else None
        checkpoint = CheckpointRecord(kind, name, when, dir_bytes(path), metadata, expires)

        def commit() -> None:
            record.checkpoints[checkpoint.checkpoint_id] = checkpoint
            self.runs.registry.save(record)

        return commit
