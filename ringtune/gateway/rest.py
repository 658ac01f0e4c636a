"""The REST side of the protocol (no futures): training runs, checkpoints, weights info, capabilities, sessions.

Checkpoint TTL, publish and copy are :mod:`ringtune.gateway.checkpoint_admin`'s; the SDK routes this server
refuses are listed in :mod:`ringtune.gateway.sdk_routes`.

Functions of a :class:`~ringtune.gateway.service.GatewayService`, run on the event loop thread; unknown ids
raise :class:`~ringtune.gateway.refusal.RefusedError` 404, malformed ones 400.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway import translate
from ringtune.gateway.downloads import confined_file
from ringtune.gateway.futures import Outcome
from ringtune.gateway.refusal import RefusedError
from ringtune.gateway.service import GatewayService
from ringtune.gateway.state import RunRecord

MAX_PAGE = 1000


def _page(limit: int, offset: int) -> tuple[int, int]:
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise RefusedError(400, f"limit={limit} must be in [1, {MAX_PAGE}] and offset={offset} >= 0")
    return limit, offset


def _record(service: GatewayService, run_id: str) -> RunRecord:
    record = service.registry.runs.get(run_id)
    if record is None:
        raise RefusedError(404, f"training_run_id={run_id!r}: no such training run")
    return record


def list_training_runs(service: GatewayService, limit: int, offset: int) -> dict[str, Any]:
    """``TrainingRunsResponse``: newest first, paginated."""
    limit, offset = _page(limit, offset)
    runs = sorted(service.registry.runs.values(), key=lambda r: r.created, reverse=True)
    return {
        "training_runs": [r.to_wire() for r in runs[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
    }


def get_training_run(service: GatewayService, run_id: str) -> dict[str, Any]:
    """``TrainingRun`` (with the ``user_metadata`` given at creation)."""
    return _record(service, run_id).to_wire()


def list_checkpoints(service: GatewayService, run_id: str) -> dict[str, Any]:
    """``CheckpointsListResponse`` of one run, oldest first."""
    record = _record(service, run_id)
    checkpoints = sorted(record.checkpoints.values(), key=lambda c: c.time)
    return {"checkpoints": [c.to_wire(run_id) for c in checkpoints], "cursor": None}


def list_user_checkpoints(service: GatewayService, limit: int, offset: int) -> dict[str, Any]:
    """Every run's checkpoints, newest first, paginated."""
    limit, offset = _page(limit, offset)
    found = [(c.time, c.to_wire(r.run_id)) for r in service.registry.runs.values() for c in r.checkpoints.values()]
    found.sort(key=lambda item: item[0], reverse=True)
    return {
        "checkpoints": [wire for _, wire in found[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
    }


async def delete_checkpoint(service: GatewayService, run_id: str, checkpoint_id: str) -> dict[str, Any]:
    """Remove a checkpoint's files and record (``checkpoint_id`` = ``weights/<name>`` or ``sampler_weights/<name>``)."""
    record = _record(service, run_id)
    try:
        kind, name = translate.parse_checkpoint_id("checkpoint_id", checkpoint_id)
    except UserInputError as exc:
        raise RefusedError(400, str(exc)) from None
    checkpoint = record.checkpoints.pop(f"{kind}/{name}", None)
    if checkpoint is None:
        raise RefusedError(404, f"checkpoint_id={checkpoint_id!r}: run {run_id} has no such checkpoint")
    service.registry.save(record)
    await asyncio.to_thread(service.paths.delete, run_id, kind, name)
    return {}


def weights_info(service: GatewayService, tinker_path: str) -> dict[str, Any]:
    """``WeightsInfoResponse`` of a checkpoint path: a LoRA run's rank and target groups, or ``is_lora`` false."""
    try:
        parsed = translate.parse_tinker_path("tinker_path", tinker_path)
    except UserInputError as exc:
        raise RefusedError(400, str(exc)) from None
    record = _record(service, parsed.run_id)
    if parsed.checkpoint_id not in record.checkpoints:
        raise RefusedError(
            404, f"tinker_path={tinker_path!r}: run {parsed.run_id} has no checkpoint {parsed.checkpoint_id}"
        )
    lora = record.lora
    return {
        "base_model": record.base_model,
        "is_lora": lora is not None,
        "lora_rank": None if lora is None else lora["rank"],
        **({} if lora is None else {k: lora[k] for k in ("train_mlp", "train_attn", "train_unembed")}),
        "optimizer_config": {"type": "adamw"},
    }


def server_capabilities(service: GatewayService) -> dict[str, Any]:
    """``GetServerCapabilitiesResponse``: every served model under its name and each alias (trainable and
    sampleable), the first ``--model`` first.

    The extra ``ringtune`` key (ignored by the SDK, which drops unknown fields) describes the layout for
    ``ringtune parity run``: DP, CP, dtype, per-rank token budget, context length, vocabulary, CP modes and the
    ``image_dir`` images are decoded with (None: a text model) of the first model, and under ``models`` each served
    model's name, aliases, architecture and vocabulary.
    """
    models = service.backend.models()
    info = models[0]
    layout = {
        "arch": info.arch,
        "dp_size": info.dp_size,
        "cp_size": info.cp_size,
        "dtype": info.dtype,
        "max_tokens_per_rank": info.max_tokens_per_rank,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "image_dir": info.image_dir,
        **dict(info.modes),
        "models": [
            {"model_name": m.model_name, "aliases": list(m.aliases), "arch": m.arch, "vocab_size": m.vocab_size}
            for m in models
        ],
    }
    return {
        "supported_models": [
            {"model_name": name, "max_context_length": m.context_length, "trainable": True, "sampleable": True}
            for m in models
            for name in (m.model_name, *m.aliases)
        ],
        "ringtune": layout,
    }


def get_sampler(service: GatewayService, sampler_id: str) -> dict[str, Any]:
    """``GetSamplerResponse`` of a sampling session (``create_sampling_session`` or an unnamed
    ``save_weights_for_sampler``)."""
    entry = service.sampling.sessions.get(sampler_id)
    if entry is None:
        raise RefusedError(404, f"sampler_id={sampler_id!r}: no such sampling session")
    return {"sampler_id": sampler_id, "base_model": entry.base_model, "model_path": entry.model_path}


def list_sessions(service: GatewayService, limit: int, offset: int) -> dict[str, Any]:
    """``ListSessionsResponse``: the session ids this server knows (open or finished since it started; a
    restart keeps only the open ones it restores), newest first, paginated."""
    limit, offset = _page(limit, offset)
    sessions = sorted(service.registry.sessions.values(), key=lambda s: s.created, reverse=True)
    return {"sessions": [s.session_id for s in sessions[offset : offset + limit]]}


def get_session(service: GatewayService, session_id: str) -> dict[str, Any]:
    """``GetSessionResponse``: the session's training runs (created, loaded or copied into it), its live sampling
    sessions and its ``user_metadata`` (values as strings). RefusedError 404 for an unknown session."""
    session = service.registry.sessions.get(session_id)
    if session is None:
        raise RefusedError(404, f"session_id={session_id!r}: no such session")
    prefix = f"{session_id}:sample:"
    return {
        "training_run_ids": list(session.runs),
        "sampler_ids": [sid for sid in service.sampling.sessions if sid.startswith(prefix)],
        "user_metadata": {str(k): str(v) for k, v in session.user_metadata.items()} or None,
    }


def cancel_future(service: GatewayService, request_id: str) -> None:
    """``cancel_future`` (the SDK sends it for a sampling future it abandoned): the future fails at once with a
    ``user`` error saying so and its result is dropped when it comes; the decode itself is not stopped.
    RefusedError 404 for an unknown request_id, 400 for one that is not a sampling request."""
    futures = service.futures
    if not futures.known(request_id):
        raise RefusedError(404, f"request_id={request_id!r}: unknown (never issued, or dropped after retrieval)")
    if not request_id.startswith("sample-"):
        raise RefusedError(400, f"request_id={request_id!r}: only sampling requests can be cancelled")
    futures.resolve(request_id, Outcome.error(f"request {request_id} was cancelled by the client", "user"))


def external_weights_urls(service: GatewayService, run_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
    """``ExternalWeightsUrlsResponse``: one signed URL per file of ``external_weights/<name>`` (404 otherwise)."""
    record = _record(service, run_id)
    try:
        kind, name = translate.parse_checkpoint_id("checkpoint_id", checkpoint_id)
    except UserInputError as exc:
        raise RefusedError(400, str(exc)) from None
    if kind != "external_weights":
        raise RefusedError(400, f"checkpoint_id={checkpoint_id!r}: only external_weights/<name> checkpoints download")
    if checkpoint_id not in record.checkpoints:
        raise RefusedError(404, f"checkpoint_id={checkpoint_id!r}: run {run_id} has no such checkpoint")
    urls, expires = service.downloads.urls(base_url, run_id, name, service.paths.checkpoint(run_id, kind, name))
    return {"urls": urls, "expires": expires.isoformat()}


def download_file(service: GatewayService, run_id: str, name: str, file: str, expires: str, sig: str) -> Path:
    """The file a signed download URL names (403 for a bad or expired signature, 404 for a missing file)."""
    why = service.downloads.check(run_id, name, file, expires, sig)
    if why is not None:
        raise RefusedError(403, f"download of {run_id}/external_weights/{name}/{file}: {why}")
    try:
        directory = service.paths.checkpoint(run_id, "external_weights", name)
    except UserInputError as exc:
        raise RefusedError(400, str(exc)) from None
    path = confined_file(directory, file)
    if path is None:
        raise RefusedError(404, f"{run_id}/external_weights/{name} has no file {file!r}")
    return path
