"""Sessions, training-run records and their checkpoint lists (the gateway's protocol state).

A run record outlives its session and the server: it is written to ``<root>/<run_id>/run.json`` on every
change and read back at start-up (as not live), so ``training_runs``, checkpoint lists and
create-via-load keep working. The record also says whether the run was live when last written, and each open
session is written to ``<root>/.sessions/<id>.json``: a server started with ``--restore-live-runs`` (and every
torchrun restart) brings those sessions and their live runs back (:mod:`ringtune.gateway.restore`); any other
start forgets them. Event-loop thread only.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ringtune.gateway.futures import SeqGate
from ringtune.gateway.paths import KINDS, CheckpointPaths

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
RUN_FORMAT = "ringtune.gateway.run/1"
SESSIONS_DIR = ".sessions"
SESSION_FORMAT = "ringtune.gateway.session/1"


def now_utc() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


@dataclass
class CheckpointRecord:
    """One saved checkpoint of a run (``kind``: ``weights`` = training state, ``sampler_weights`` = HF export)."""

    kind: str
    name: str
    time: datetime
    size_bytes: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    expires_at: datetime | None = None
    public: bool = False
    """Published (``publish_checkpoint``): a recorded flag; docs/gateway.md says what it means here."""

    @property
    def checkpoint_id(self) -> str:
        """``<kind>/<name>``, as in ``tinker://<run>/<kind>/<name>``."""
        return f"{self.kind}/{self.name}"

    def to_wire(self, run_id: str) -> dict[str, Any]:
        """The SDK's ``Checkpoint`` object."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": KINDS[self.kind],
            "time": self.time.isoformat(),
            "tinker_path": f"tinker://{run_id}/{self.checkpoint_id}",
            "size_bytes": self.size_bytes,
            "public": self.public,
            "user_metadata": self.user_metadata or None,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
        }

    def to_json(self) -> dict[str, Any]:
        """The record as stored in its run's ``run.json`` (:meth:`from_json` reads it back)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "time": self.time.isoformat(),
            "size_bytes": self.size_bytes,
            "user_metadata": self.user_metadata,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "public": self.public,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> CheckpointRecord:
        """A record from :meth:`to_json`'s dict."""
        return CheckpointRecord(
            kind=d["kind"],
            name=d["name"],
            time=datetime.fromisoformat(d["time"]),
            size_bytes=d.get("size_bytes"),
            user_metadata=dict(d.get("user_metadata") or {}),
            expires_at=datetime.fromisoformat(d["expires_at"]) if d.get("expires_at") else None,
            public=bool(d.get("public", False)),
        )


@dataclass
class RunRecord:
    """A training run (= Tinker model id). ``live``: the backend holds its weights now."""

    run_id: str
    base_model: str
    session_id: str
    user_metadata: dict[str, str]
    created: datetime
    last_request_time: datetime
    live: bool = False
    checkpoints: dict[str, CheckpointRecord] = field(default_factory=dict)
    gate: SeqGate = field(default_factory=SeqGate)
    freed: bool = False
    """True once the backend was told to free it (a finished session, or a failed create)."""
    lora: dict[str, Any] | None = None
    """A LoRA run's spec (:meth:`ringtune.models.lora.LoraSpec.to_dict`); None: full fine-tuning."""
    was_live: bool = False
    """Read from disk: the run was live when the previous server last wrote its record."""

    def touch(self) -> None:
        """The run got a request now (``last_request_time``)."""
        self.last_request_time = now_utc()

    def last(self, kind: str) -> CheckpointRecord | None:
        """The run's newest checkpoint of ``kind`` (``weights``, ``sampler_weights``, ...), or None."""
        found = [c for c in self.checkpoints.values() if c.kind == kind]
        return max(found, key=lambda c: c.time) if found else None

    def to_wire(self) -> dict[str, Any]:
        """The SDK's ``TrainingRun`` object (``is_lora`` and ``lora_rank`` of a LoRA run; false / None otherwise)."""
        last, last_sampler = self.last("weights"), self.last("sampler_weights")
        return {
            "training_run_id": self.run_id,
            "base_model": self.base_model,
            "model_owner": "local",
            "is_lora": self.lora is not None,
            "corrupted": False,
            "lora_rank": None if self.lora is None else self.lora["rank"],
            "last_request_time": self.last_request_time.isoformat(),
            "last_checkpoint": last.to_wire(self.run_id) if last else None,
            "last_sampler_checkpoint": last_sampler.to_wire(self.run_id) if last_sampler else None,
            "user_metadata": self.user_metadata or None,
        }

    def to_json(self) -> dict[str, Any]:
        """The record as stored in ``<root>/<run_id>/run.json`` (:meth:`from_json` reads it back)."""
        return {
            "format": RUN_FORMAT,
            "run_id": self.run_id,
            "base_model": self.base_model,
            "session_id": self.session_id,
            "user_metadata": self.user_metadata,
            "created": self.created.isoformat(),
            "last_request_time": self.last_request_time.isoformat(),
            "checkpoints": [c.to_json() for c in self.checkpoints.values()],
            "lora": self.lora,
            "live": self.live,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> RunRecord:
        """A record from :meth:`to_json`'s dict (``was_live`` set from its ``live``)."""
        checkpoints = [CheckpointRecord.from_json(c) for c in d.get("checkpoints", [])]
        return RunRecord(
            run_id=d["run_id"],
            base_model=d["base_model"],
            session_id=d["session_id"],
            user_metadata=dict(d.get("user_metadata") or {}),
            created=datetime.fromisoformat(d["created"]),
            last_request_time=datetime.fromisoformat(d["last_request_time"]),
            checkpoints={c.checkpoint_id: c for c in checkpoints},
            lora=d.get("lora"),
            was_live=bool(d.get("live", False)),
        )


@dataclass
class Session:
    """A client session: created by ``create_session``, kept alive by heartbeats, ended by ``finish``."""

    session_id: str
    created: float
    last_heartbeat: float
    user_metadata: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    finished: str | None = None
    """None while open; else why it ended (``success``, ``errored``, ``interrupted``, ``expired``)."""
    runs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The open session as stored under the checkpoint root (restored by ``--restore-live-runs``)."""
        return {
            "format": SESSION_FORMAT,
            "session_id": self.session_id,
            "user_metadata": self.user_metadata,
            "tags": self.tags,
        }


class Registry:
    """Sessions (in memory) and run records (in memory and on disk under the checkpoint root)."""

    def __init__(self, paths: CheckpointPaths, clock=time.monotonic) -> None:
        self.paths, self.clock = paths, clock
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, RunRecord] = {}
        self._load()

    def _load(self) -> None:
        for run_file in sorted(self.paths.root.glob(f"*/{RUN_FILE}")):
            try:
                data = json.loads(run_file.read_text())
                if data.get("format") != RUN_FORMAT:
                    raise ValueError(f"format {data.get('format')!r}")
                record = RunRecord.from_json(data)
                self.runs[record.run_id] = record
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable run record %s: %s", run_file, exc)
                continue
            self._reconcile(record)

    def _reconcile(self, record: RunRecord) -> None:
        """At start-up, make ``record``'s checkpoint list what is complete on disk: leftovers of saves cut by
        a kill are removed (never listed), a listed checkpoint that is not complete is dropped, and a complete
        one the record missed (the server died between the save and its record) is added."""
        root = self.paths.engine_root
        for leftover in root.sweep(record.run_id):
            log.warning("run %s: removed %s, left by a save that did not finish", record.run_id, leftover)
        found = {info.ref.checkpoint_id: info for info in root.checkpoints(record.run_id)}
        changed = False
        for checkpoint_id in [c for c in record.checkpoints if c not in found]:
            log.warning("run %s: checkpoint %s is not complete on disk; not listed", record.run_id, checkpoint_id)
            del record.checkpoints[checkpoint_id]
            changed = True
        for checkpoint_id, info in found.items():
            if checkpoint_id not in record.checkpoints:
                when = datetime.fromtimestamp(info.mtime, UTC)
                record.checkpoints[checkpoint_id] = CheckpointRecord(
                    info.ref.kind, info.ref.name, when, info.size_bytes
                )
                log.warning(
                    "run %s: complete checkpoint %s was not in its record; listed now", record.run_id, checkpoint_id
                )
                changed = True
        if changed:
            self.save(record)

    def new_session(self, user_metadata: dict[str, Any] | None, tags: list[str]) -> Session:
        """A new open session with a fresh unique id (written under ``.sessions/`` until it finishes)."""
        now = self.clock()
        session = Session(f"s-{uuid.uuid4().hex[:16]}", now, now, dict(user_metadata or {}), list(tags))
        self.sessions[session.session_id] = session
        self._write_session(session)
        return session

    def _write_session(self, session: Session) -> None:
        directory = self.paths.root / SESSIONS_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{session.session_id}.{uuid.uuid4().hex}"
            tmp.write_text(json.dumps(session.to_json()))
            os.replace(tmp, directory / f"{session.session_id}.json")
        except OSError as exc:  # a session that cannot be written is only not restorable
            log.warning("session %s not written: %s", session.session_id, exc)

    def finished(self, session: Session) -> None:
        """``session`` ended: it is no longer restorable."""
        (self.paths.root / SESSIONS_DIR / f"{session.session_id}.json").unlink(missing_ok=True)

    def take_saved_sessions(self, restore: bool) -> list[Session]:
        """The sessions the previous server left open (read once, at start-up): open again when ``restore``
        (their heartbeat clock starts now), else forgotten (their files removed)."""
        directory = self.paths.root / SESSIONS_DIR
        out = []
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                data = json.loads(path.read_text())
                if data.get("format") != SESSION_FORMAT:
                    raise ValueError(f"format {data.get('format')!r}")
                now = self.clock()
                session = Session(
                    data["session_id"], now, now, dict(data.get("user_metadata") or {}), list(data["tags"])
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable session record %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            if not restore:
                path.unlink(missing_ok=True)
                continue
            self.sessions[session.session_id] = session
            out.append(session)
        return out

    def save(self, record: RunRecord) -> None:
        """Write ``record`` to ``<root>/<run_id>/run.json`` atomically."""
        directory = self.paths.run_dir(record.run_id)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{RUN_FILE}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(record.to_json(), indent=2))
        os.replace(tmp, directory / RUN_FILE)

    def live_runs(self) -> list[RunRecord]:
        """The runs live now (created or restored, not freed)."""
        return [r for r in self.runs.values() if r.live]
