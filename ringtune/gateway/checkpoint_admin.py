"""Checkpoint housekeeping the REST client asks for: TTL, publish / unpublish, ``copy_weights``.

Routes (SDK 0.38 ``RestClient``), each on the event loop thread:

- ``PUT /training_runs/<run>/checkpoints/<kind>/<name>/ttl`` ``{"ttl_seconds"}``: the checkpoint expires that
  many seconds from now (3600 .. 10 years), or never (``null``); stored in the run's record (``expires_at``) and
  honoured by :mod:`ringtune.gateway.checkpoint_reaper`.
- ``POST`` / ``DELETE .../publish``: sets / clears the checkpoint's ``public`` flag (listed, kept across restarts).
  A self-hosted server has one API key and no users or projects: whoever holds the key can already list, load,
  sample and download every checkpoint, and nobody else can reach any. Publishing grants no access; it is a
  recorded mark (what hosted Tinker shows as a public checkpoint). Both are idempotent (a retried call succeeds).
- ``POST /copy_weights`` ``{"source_path", "session_id" + "model_seq_id" | "destination_project_id",
  "ttl_seconds"}``: the checkpoint (either kind) under a new, not trainable run (``<session>:train:<seq>`` in that
  session, or ``copy-<hex>`` for a project, which is recorded in the copy's ``user_metadata`` since projects do
  not exist here); files are hard links (no bytes duplicated; the source may be deleted afterwards). A retry with
  the same ``X-Idempotency-Key`` gets the first copy's answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any

from ringtune.gateway import translate
from ringtune.gateway.paths import CheckpointPaths, dir_bytes
from ringtune.gateway.refusal import RefusedError, refusing_bad_input
from ringtune.gateway.runs import RunBook
from ringtune.gateway.state import CheckpointRecord, RunRecord, now_utc
from ringtune.gateway.wire import Body

MAX_IDEMPOTENCY_KEYS = 1024
"""Answers of ``copy_weights`` kept for retries with the same ``X-Idempotency-Key``."""


class CopyWeightsBody(Body):
    """``copy_weights`` (SDK 0.38's ``CopyWeightsRequest``)."""

    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


class TtlBody(Body):
    """``PUT .../ttl``: seconds from now, or None to remove the expiry."""

    ttl_seconds: int | None = None


class CheckpointAdmin:
    """TTL, publish and copy over ``runs`` (records, sessions) and ``paths`` (the checkpoint root)."""

    def __init__(self, runs: RunBook, paths: CheckpointPaths) -> None:
        self.runs, self.paths = runs, paths
        self.copies: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def checkpoint(self, run_id: str, checkpoint_id: str) -> tuple[RunRecord, CheckpointRecord]:
        """The run and its listed checkpoint ``<kind>/<name>``; RefusedError 400 malformed, 404 unknown."""
        record = self.runs.run(run_id, live=False)
        with refusing_bad_input():
            kind, name = translate.parse_checkpoint_id("checkpoint_id", checkpoint_id)
        found = record.checkpoints.get(f"{kind}/{name}")
        if found is None:
            raise RefusedError(404, f"checkpoint_id={checkpoint_id!r}: run {run_id} has no such checkpoint")
        return record, found

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """The checkpoint expires ``ttl_seconds`` from now (None: never); RefusedError 400 out of range."""
        record, checkpoint = self.checkpoint(run_id, checkpoint_id)
        with refusing_bad_input():
            ttl = translate.check_ttl(ttl_seconds)
        checkpoint.expires_at = None if ttl is None else now_utc() + timedelta(seconds=ttl)
        self.runs.registry.save(record)

    def set_public(self, run_id: str, checkpoint_id: str, public: bool) -> None:
        """Publish (``public``) or unpublish the checkpoint: its recorded flag (module docstring)."""
        record, checkpoint = self.checkpoint(run_id, checkpoint_id)
        if checkpoint.public != public:
            checkpoint.public = public
            self.runs.registry.save(record)

    async def copy_weights(self, body: CopyWeightsBody, idempotency_key: str | None) -> dict[str, Any]:
        """``{"tinker_path"}`` of a hard-linked copy of ``body.source_path`` under a new run (module docstring).
        RefusedError 400 for a bad path, TTL or destination, or a taken ``model_seq_id``; 404 for an unknown
        source; 410 for a finished session."""
        if idempotency_key is not None and idempotency_key in self.copies:
            return self.copies[idempotency_key]
        with refusing_bad_input():
            source = translate.parse_tinker_path("source_path", body.source_path)
            ttl = translate.check_ttl(body.ttl_seconds)
        origin, checkpoint = self.checkpoint(source.run_id, source.checkpoint_id)
        if body.session_id is not None:
            session = self.runs.session(body.session_id)
            seq = body.model_seq_id
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise RefusedError(400, f"model_seq_id={seq!r}: copy_weights with a session_id needs an integer >= 0")
            run_id, session_id = f"{session.session_id}:train:{seq}", session.session_id
            if run_id in self.runs.registry.runs:
                raise RefusedError(400, f"model_seq_id={seq}: run {run_id} exists already")
            metadata = {"copied_from": body.source_path}
        elif body.destination_project_id:
            run_id, session_id = f"copy-{uuid.uuid4().hex[:16]}", ""
            metadata = {"copied_from": body.source_path, "project_id": body.destination_project_id}
        else:
            raise RefusedError(400, "copy_weights needs session_id + model_seq_id or destination_project_id")
        target = self.paths.checkpoint(run_id, source.kind, source.name)
        await asyncio.to_thread(link_copy, self.paths.checkpoint(source.run_id, source.kind, source.name), target)
        now = now_utc()
        copy = RunRecord(run_id, origin.base_model, session_id, metadata, now, now, lora=origin.lora)
        expires = None if ttl is None else now + timedelta(seconds=ttl)
        listed = CheckpointRecord(source.kind, source.name, now, dir_bytes(target), checkpoint.user_metadata, expires)
        copy.checkpoints[listed.checkpoint_id] = listed
        self.runs.registry.runs[run_id] = copy
        if body.session_id is not None:
            self.runs.registry.sessions[session_id].runs.append(run_id)
        self.runs.registry.save(copy)
        answer = {"tinker_path": f"tinker://{run_id}/{listed.checkpoint_id}"}
        if idempotency_key is not None:
            self.copies[idempotency_key] = answer
            while len(self.copies) > MAX_IDEMPOTENCY_KEYS:
                self.copies.popitem(last=False)
        return answer


def link_copy(source: Path, target: Path) -> None:
    """Copy checkpoint directory ``source`` (symlinks followed) to ``target`` as hard links (a plain copy where
    the filesystem refuses links), through a hidden staging directory renamed into place: ``target`` appears
    complete or not at all (a leftover staging directory is swept at the next start)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.ckpt-{uuid.uuid4().hex}.partial")

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source.resolve(), staging, copy_function=link)
    os.replace(staging, target)
