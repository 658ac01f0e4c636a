"""``create_sampling_session``: a sampling session on a served base model or on a run's checkpoint.

The session itself (its snapshot on the backend, its requests) is :class:`~ringtune.gateway.sampling.SamplingService`'s;
this module resolves what the client names into a :class:`~ringtune.sample.pool.SamplerSource` and registers it on
the backend thread. The SDK sends ``base_model``, ``model_path`` or both:

- ``base_model`` alone: the served base model of that name.
- ``model_path`` = ``tinker://<run>/sampler_weights/<name>``: that HF export.
- ``model_path`` = ``tinker://<run>/weights/<name>``: that training checkpoint's weights. The sampler reads an HF
  export, so the first session on a checkpoint makes one on the backend thread (a transient run of the
  checkpoint's base and LoRA spec, its weights loaded without the optimizer, exported, freed; it needs the
  memory of one run, admitted like a ``create_model``) under
  ``<root>/<run>/weights_export/<name>.<version>`` (:meth:`~ringtune.gateway.paths.CheckpointPaths.weights_export`);
  later sessions on the same version reuse it, and it is deleted with the checkpoint.
- both: they must agree (``base_model`` names the model the checkpoint was trained from, by its name or an
  alias); otherwise a ``user`` error naming both.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from ringtune.gateway import translate
from ringtune.gateway.dispatch import Dispatcher
from ringtune.gateway.paths import CheckpointPaths
from ringtune.gateway.refusal import RefusedError, refusing_bad_input
from ringtune.gateway.runs import RunBook
from ringtune.gateway.sampling import CreateSamplingSessionBody, SamplingService, new_sampler_id
from ringtune.gateway.state import RunRecord
from ringtune.sample.pool import SamplerSource

SAMPLED_KINDS = ("sampler_weights", "weights")
"""Checkpoint kinds a sampling session can be made on."""


def check_agreement(runs: RunBook, base_model: str, model_path: str, origin: RunRecord) -> None:
    """RefusedError 400 (``user``) naming both fields unless ``base_model`` names the model ``origin`` (the run of
    ``model_path``) was trained from: the same name, or two names of one served model."""
    if base_model == origin.base_model:
        return
    for model in runs.backend.models():
        names = (model.model_name, *model.aliases)
        if base_model in names and origin.base_model in names:
            return
    raise RefusedError(
        400,
        f"base_model={base_model!r} does not match model_path={model_path!r}, a checkpoint of base model "
        f"{origin.base_model!r}; send base_model={origin.base_model!r} or leave base_model out",
    )


async def create_sampling_session(
    body: CreateSamplingSessionBody,
    runs: RunBook,
    paths: CheckpointPaths,
    sampling: SamplingService,
    dispatcher: Dispatcher,
) -> dict[str, Any]:
    """A sampling session on ``body.base_model`` and/or the checkpoint ``body.model_path`` (module docstring),
    registered on the backend thread; ``{"sampling_session_id", "type"}``. RefusedError 400 for neither, for a
    base model not served here, for a malformed path or for a base model and path that disagree; 404 for an
    unknown run or checkpoint."""
    session = runs.session(body.session_id)
    if body.model_path is None and body.base_model is None:
        raise RefusedError(400, "create_sampling_session needs base_model, model_path or both")
    if body.model_path is None:
        assert body.base_model is not None
        model = runs.check_base_model(body.base_model).model_name
        base_model, where = body.base_model, SamplerSource(model=model)
    else:
        with refusing_bad_input():
            source = translate.parse_tinker_path("model_path", body.model_path, kinds=SAMPLED_KINDS)
        origin = runs.run(source.run_id, live=False)
        if body.base_model is not None:
            check_agreement(runs, body.base_model, body.model_path, origin)
            runs.check_base_model(body.base_model)
        if source.checkpoint_id not in origin.checkpoints:
            raise RefusedError(404, f"model_path={body.model_path!r}: run {source.run_id} has no such checkpoint")
        if source.kind == "weights":
            path = await weights_export(runs, paths, dispatcher, origin, source.name)
        else:
            path = paths.checkpoint(source.run_id, "sampler_weights", source.name)
            if not (path / "config.json").is_file():
                raise RefusedError(404, f"model_path={body.model_path!r}: no such sampler checkpoint")
        model = runs.model_of(origin).model_name
        base_model, where = origin.base_model, SamplerSource(path=str(path), model=model)
    sampler_id = new_sampler_id(session.session_id, body.sampling_session_seq_id)
    await dispatcher.on_backend(lambda: sampling.register(sampler_id, base_model, body.model_path, where))
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


async def weights_export(
    runs: RunBook, paths: CheckpointPaths, dispatcher: Dispatcher, origin: RunRecord, name: str
) -> Path:
    """The HF export of training checkpoint ``weights/<name>`` of run ``origin``, made now on the backend thread
    if this version of the checkpoint has none (module docstring). RefusedError 400 if memory does not admit the
    transient run; a failed load or export is a ``user`` / ``server`` error like any backend call's."""
    checkpoint = paths.checkpoint(origin.run_id, "weights", name)
    export = paths.weights_export(origin.run_id, name)
    if (export / "config.json").is_file():
        return export
    runs.admit(origin.base_model, origin.lora)
    transient = f"{origin.run_id}:export:{uuid.uuid4().hex[:8]}"

    def job() -> None:
        if (export / "config.json").is_file():  # another session's job made it meanwhile
            return
        runs.backend.create_run(transient, origin.base_model, origin.lora)
        try:
            runs.backend.load_state(transient, str(checkpoint), False)
            runs.backend.export_for_sampler(transient, str(export))
        finally:
            runs.backend.free_run(transient)

    await dispatcher.on_backend(job)
    return export
