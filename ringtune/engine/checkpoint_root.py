"""The checkpoint root: the one directory where the server keeps every run's checkpoints, and the only way a
(run id, kind, name) becomes a path.

Layout::

    <root>/<run_id>/weights/<name>           training state (weights + optimizer + step; checkpoint.py)
    <root>/<run_id>/sampler_weights/<name>   HF export of the weights, for sampling (export_hf_weights)
    <root>/<run_id>/external_weights/<name>  the same HF export, for download (save_weights_external)

which is the tinker path ``tinker://<run_id>/<kind>/<name>`` (SDK checkpoint id ``<kind>/<name>``,
checkpoint type ``training`` / ``sampler`` / ``external``). Run ids and names follow
:func:`~ringtune.engine.checkpoint_layout.check_name`: characters ``[A-Za-z0-9._:-]``, no leading ``.``,
1..128 characters for a name and 1..255 for a run id; so neither holds ``/``, ``\\``, NUL or a control
character, and ``.``/``..`` are excluded. On top of that every path is resolved (symlinks followed) and must
stay inside the root. Bad input raises :class:`UserInputError` naming the field, the value and the rule.

Listing and deleting are local filesystem work in the calling process (the gateway's), no communication;
with several hosts the root must be a shared filesystem (DCP writes each rank's file there).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ringtune.engine.checkpoint_layout import RUN_ID_MAX, check_name, is_complete, remove_checkpoint
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import INDEX_NAME, SINGLE_NAME

KINDS: dict[str, str] = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""Checkpoint kinds (the tinker path segment) and the SDK ``checkpoint_type`` of each."""
TINKER_SCHEME = "tinker://"


class CheckpointNotFoundError(UserInputError):
    """No complete checkpoint of that run, kind and name (the gateway answers 404)."""


@dataclass(frozen=True)
class CheckpointRef:
    """A checked (run id, kind, name); see the module docstring for the rules."""

    run_id: str
    kind: str
    name: str

    @property
    def tinker_path(self) -> str:
        """``tinker://<run_id>/<kind>/<name>``."""
        return f"{TINKER_SCHEME}{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """``<kind>/<name>``, the SDK's checkpoint id."""
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        """``training`` for ``weights``, ``sampler`` for ``sampler_weights``, ``external`` for ``external_weights``."""
        return KINDS[self.kind]


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint under the root: its reference, path, bytes on disk and publish time.

    ``size_bytes``: the sum of its files' sizes; ``mtime``: seconds since the epoch at which it was published
    (the mtime of the entry at ``path`` itself, not following the symlink of a training checkpoint).
    """

    ref: CheckpointRef
    path: Path
    size_bytes: int
    mtime: float


def check_kind(kind: object, *, field: str = "checkpoint kind") -> str:
    """``kind`` if it is one of :data:`KINDS`, else UserInputError naming ``field``, the value and the kinds."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise UserInputError(f"{field}={kind!r} is not one of {list(KINDS)}")
    return kind


def _is_hf_export(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / SINGLE_NAME).is_file() or (path / INDEX_NAME).is_file())


class CheckpointRoot:
    """The checkpoint directory of a server; every path it gives is checked and confined (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        """Use ``directory`` (created if missing) as the root; UserInputError if it exists and is not a directory."""
        directory = Path(directory)
        if os.path.lexists(directory) and not directory.is_dir():
            raise UserInputError(f"checkpoint root {directory} exists and is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory.resolve()

    def __repr__(self) -> str:
        return f"CheckpointRoot({str(self.directory)!r})"

    # ------------------------------------------------------------------ names -> paths

    def ref(self, run_id: str, kind: str, name: str) -> CheckpointRef:
        """The checked reference; UserInputError naming ``run_id``, ``kind`` or ``name`` if one is invalid."""
        check_name(run_id, field="run_id", max_len=RUN_ID_MAX)
        check_kind(kind)
        check_name(name, field="checkpoint name")
        return CheckpointRef(run_id=run_id, kind=kind, name=name)

    @staticmethod
    def parse(tinker_path: str, *, field: str = "path") -> CheckpointRef:
        """``tinker://<run_id>/<kind>/<name>`` as a checked reference; UserInputError naming ``field`` if not."""
        if not isinstance(tinker_path, str) or not tinker_path.startswith(TINKER_SCHEME):
            raise UserInputError(f"{field}={tinker_path!r} is not a tinker path (tinker://<run_id>/<kind>/<name>)")
        parts = tinker_path[len(TINKER_SCHEME) :].split("/")
        if len(parts) != 3:
            raise UserInputError(
                f"{field}={tinker_path!r} has {len(parts)} '/'-separated parts after tinker://; "
                "must be exactly 3: <run_id>/<kind>/<name>"
            )
        run_id, kind, name = parts
        check_name(run_id, field=f"{field} run_id", max_len=RUN_ID_MAX)
        check_kind(kind, field=f"{field} kind")
        check_name(name, field=f"{field} checkpoint name")
        return CheckpointRef(run_id=run_id, kind=kind, name=name)

    def _inside(self, path: Path) -> Path:
        """``path`` if it resolves (symlinks followed) inside the root; else UserInputError."""
        real = Path(os.path.realpath(path))
        if real != self.directory and self.directory not in real.parents:
            raise UserInputError(f"checkpoint path {path} resolves to {real}, outside the checkpoint root")
        return path

    def run_dir(self, run_id: str) -> Path:
        """``<root>/<run_id>`` (not created); UserInputError for an invalid run id."""
        return self._inside(self.directory / check_name(run_id, field="run_id", max_len=RUN_ID_MAX))

    def path(self, run_id: str, kind: str, name: str) -> Path:
        """``<root>/<run_id>/<kind>/<name>`` (not created): where to save or load; checked and confined."""
        return self.path_of(self.ref(run_id, kind, name))

    def path_of(self, ref: CheckpointRef) -> Path:
        """The path of an already checked reference (confinement is checked again: symlinks may have changed)."""
        return self._inside(self.directory / ref.run_id / ref.kind / ref.name)

    def resolve(self, tinker_path: str, *, field: str = "path") -> Path:
        """The path of a tinker path (:meth:`parse`, then :meth:`path_of`)."""
        return self.path_of(self.parse(tinker_path, field=field))

    # ------------------------------------------------------------------ list / delete

    def _info(self, ref: CheckpointRef) -> CheckpointInfo | None:
        """The checkpoint's info if a complete one is there, else None (also if it vanished meanwhile)."""
        path = self.path_of(ref)
        try:
            complete = is_complete(path) if ref.kind == "weights" else _is_hf_export(path)
            if not complete:
                return None
            real = path.resolve()
            size = sum(f.stat().st_size for f in real.rglob("*") if f.is_file())
            mtime = os.lstat(path).st_mtime
        except FileNotFoundError:  # replaced or deleted while we looked
            return None
        return CheckpointInfo(ref=ref, path=path, size_bytes=size, mtime=mtime)

    def info(self, run_id: str, kind: str, name: str) -> CheckpointInfo:
        """Size and publish time of one checkpoint; CheckpointNotFoundError if there is no complete one."""
        ref = self.ref(run_id, kind, name)
        found = self._info(ref)
        if found is None:
            raise CheckpointNotFoundError(f"checkpoint {ref.tinker_path} does not exist")
        return found

    def checkpoints(self, run_id: str, kind: str | None = None) -> list[CheckpointInfo]:
        """The complete checkpoints of ``run_id`` (of ``kind``, or every kind), oldest first (then kind, name).

        Hidden entries (staging, old versions) and entries whose names break the rule are skipped; a run
        without checkpoints gives []. Contents are not verified (a load does that).
        """
        run_dir = self.run_dir(run_id)
        kinds = list(KINDS) if kind is None else [check_kind(kind)]
        found = []
        for k in kinds:
            directory = run_dir / k
            if not directory.is_dir():
                continue
            for entry in sorted(directory.iterdir()):
                try:
                    ref = self.ref(run_id, k, entry.name)
                    info = self._info(ref)
                except UserInputError:  # a hidden or foreign entry, or one that leaves the root
                    continue
                if info is not None:
                    found.append(info)
        return sorted(found, key=lambda i: (i.mtime, i.ref.kind, i.ref.name))

    def sweep(self, run_id: str) -> list[Path]:
        """Remove what killed saves left of ``run_id``: hidden staging entries (``.<name>.ckpt-<hex>.partial``,
        ``.link``, versions no name points to) and hidden export or deletion leftovers; the removed paths.

        Only when no save of the run can be running (the gateway calls it at start-up). Published checkpoints
        (a name and the version it points to) are never touched.
        """
        run_dir = self.run_dir(run_id)
        removed = []
        for kind in KINDS:
            directory = run_dir / kind
            if not directory.is_dir():
                continue
            entries = list(directory.iterdir())
            published = {e.resolve() for e in entries if e.is_symlink()}
            for entry in entries:
                if not entry.name.startswith(".") or entry.resolve() in published:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
        return removed

    def delete(self, run_id: str, kind: str, name: str) -> CheckpointInfo:
        """Delete one checkpoint and return what it was; CheckpointNotFoundError if there is no complete one.

        The name disappears in one step (unlink of the symlink, or rename of the directory to a hidden
        name), then its files are removed; a concurrent listing never sees half a checkpoint. Do not delete a
        name that is being saved.
        """
        info = self.info(run_id, kind, name)
        if kind == "weights":
            remove_checkpoint(info.path)
        else:
            hidden = info.path.with_name(f".{name}.deleted-{uuid.uuid4().hex}")
            os.replace(info.path, hidden)
            shutil.rmtree(hidden)
        return info
