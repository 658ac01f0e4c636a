"""``create_sampling_session``: a sampling session on the served base model or a run's sampler export.

The session itself (its snapshot on the backend, its requests) is :class:`~ringtune.gateway.sampling.SamplingService`'s;
this module resolves what the client names into a :class:`~ringtune.sample.pool.SamplerSource` and registers it on
the backend thread.
"""

from __future__ import annotations

from typing import Any

from ringtune.gateway import translate
from ringtune.gateway.dispatch import Dispatcher
from ringtune.gateway.paths import CheckpointPaths
from ringtune.gateway.refusal import RefusedError, refusing_bad_input
from ringtune.gateway.runs import RunBook
from ringtune.gateway.sampling import CreateSamplingSessionBody, SamplingService, new_sampler_id
from ringtune.sample.pool import SamplerSource


async def create_sampling_session(
    body: CreateSamplingSessionBody,
    runs: RunBook,
    paths: CheckpointPaths,
    sampling: SamplingService,
    dispatcher: Dispatcher,
) -> dict[str, Any]:
    """A sampling session on ``body.base_model`` or the ``tinker://<run>/sampler_weights/<name>`` export
    ``body.model_path`` (exactly one), registered on the backend thread; ``{"sampling_session_id", "type"}``.
    RefusedError 400 for both or neither or a served-elsewhere base model, 404 for an unknown export."""
    session = runs.session(body.session_id)
    if (body.model_path is None) == (body.base_model is None):
        raise RefusedError(400, "create_sampling_session needs exactly one of model_path and base_model")
    if body.model_path is not None:
        with refusing_bad_input():
            source = translate.parse_tinker_path("model_path", body.model_path, kinds=("sampler_weights",))
        run_id, name = source.run_id, source.name
        origin = runs.run(run_id, live=False)
        path = paths.checkpoint(run_id, "sampler_weights", name)
        if not (path / "config.json").is_file():
            raise RefusedError(404, f"model_path={body.model_path!r}: no such sampler checkpoint")
        model = runs.model_of(origin).model_name
        base_model, where = origin.base_model, SamplerSource(path=str(path), model=model)
    else:
        model = runs.check_base_model(body.base_model).model_name
        base_model, where = body.base_model, SamplerSource(model=model)
    sampler_id = new_sampler_id(session.session_id, body.sampling_session_seq_id)
    await dispatcher.on_backend(lambda: sampling.register(sampler_id, base_model, body.model_path, where))
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
