"""Where the gateway keeps checkpoints: ``<root>/<run_id>/<kind>/<name>``, names checked and confined.

Training and sampler checkpoints go through :class:`ringtune.engine.checkpoint_root.CheckpointRoot` (name
rules, confinement, deletion); this file adds the gateway's own entries (``run.json``, ephemeral exports) and
keeps the gateway's stricter names (no ``:``). Layout::

    <root>/<run_id>/run.json                  the run's record (base model, user_metadata, checkpoints)
    <root>/<run_id>/weights/<name>            training state (weights + AdamW + step; engine DCP format)
    <root>/<run_id>/sampler_weights/<name>    HF export for sampling
    <root>/<run_id>/ephemeral/<id>            HF export behind an ephemeral sampling session
    <root>/<run_id>/weights_export/<name>.<v> HF export of weights/<name> (version <v>) for a sampling session
                                              on that path; deleted with weights/<name>
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ringtune.engine.checkpoint_root import KINDS as CHECKPOINT_KINDS
from ringtune.engine.checkpoint_root import CheckpointNotFoundError, CheckpointRoot
from ringtune.errors import UserInputError

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
"""Checkpoint names: 1-128 characters of letters, digits, ``_ . -``; no leading dot, no ``/``."""

RUN_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,255}$")
"""Run ids (``<session_id>:train:<n>``): like names, plus ``:``."""

KINDS = CHECKPOINT_KINDS
"""tinker path kinds this gateway writes (``weights``, ``sampler_weights``, ``external_weights``), and their
``checkpoint_type`` (the engine's registry, :data:`ringtune.engine.checkpoint_root.KINDS`)."""


def check_name(field: str, name: object) -> str:
    """``name`` if it is a valid checkpoint name, else UserInputError naming ``field``, the value and the rule."""
    if not isinstance(name, str) or not NAME_RE.match(name) or name in (".", ".."):
        raise UserInputError(
            f"{field}={name!r} is not a valid checkpoint name: 1-128 characters of letters, digits, '_', '.', '-', "
            "not starting with '.' (no '/')"
        )
    return name


def check_run_id(field: str, run_id: object) -> str:
    """``run_id`` if it has the shape of a run id (letters, digits, ``_ . - :``), else UserInputError."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise UserInputError(f"{field}={run_id!r} is not a valid training run id")
    return run_id


class CheckpointPaths:
    """The checkpoint root directory and the paths under it; every path is checked to stay inside ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.engine_root = CheckpointRoot(self.root)

    def _inside(self, path: Path) -> Path:
        resolved = path.resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise UserInputError(f"path {path} leaves the checkpoint root {self.root}")
        return path

    def run_dir(self, run_id: str) -> Path:
        """``<root>/<run_id>`` (not created)."""
        return self._inside(self.root / check_run_id("run_id", run_id))

    def checkpoint(self, run_id: str, kind: str, name: str) -> Path:
        """``<root>/<run_id>/<kind>/<name>`` for ``kind`` in :data:`KINDS` or ``ephemeral`` (not created)."""
        if kind not in (*KINDS, "ephemeral"):
            raise UserInputError(f"checkpoint kind {kind!r} is not one of {[*KINDS, 'ephemeral']}")
        if kind in KINDS:
            return self.engine_root.path(run_id, kind, check_name("name", name))
        return self._inside(self.run_dir(run_id) / kind / check_name("name", name))

    def weights_export(self, run_id: str, name: str) -> Path:
        """``<root>/<run_id>/weights_export/<name>.<version>``: where the HF export of training checkpoint
        ``weights/<name>`` goes for sampling (not created). ``<version>`` names the checkpoint's current version
        (the hex of the ``.<name>.ckpt-<hex>`` it points to, or its mtime in ns for a plain directory), so an
        overwritten checkpoint gets a new export and a sampler never reads a stale one."""
        source = self.checkpoint(run_id, "weights", name)
        match = re.search(r"\.ckpt-([0-9a-f]{32})$", source.resolve().name)
        version = match.group(1) if match else str(source.stat().st_mtime_ns)
        return self._inside(self.run_dir(run_id) / "weights_export" / f"{name}.{version}")

    def delete(self, run_id: str, kind: str, name: str) -> None:
        """Remove a checkpoint's files (CheckpointRoot.delete; a name with no complete checkpoint is a no-op),
        and for ``weights`` its sampling exports (:meth:`weights_export`)."""
        try:
            self.engine_root.delete(run_id, kind, check_name("name", name))
        except CheckpointNotFoundError:
            remove_checkpoint(self.checkpoint(run_id, kind, name))  # leftovers of an incomplete save
        exports = self.run_dir(run_id) / "weights_export"
        if kind == "weights" and exports.is_dir():
            pattern = re.compile(rf"^{re.escape(name)}\.([0-9a-f]{{32}}|[0-9]+)$")
            for export in [e for e in exports.iterdir() if pattern.match(e.name)]:
                shutil.rmtree(export, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a symlinked checkpoint is followed)."""
    path = path.resolve()
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory, or an engine checkpoint (a symlink to ``.<name>.ckpt-*``) and its siblings."""
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        shutil.rmtree(target, ignore_errors=True)
    elif path.is_dir():
        shutil.rmtree(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.ckpt-[0-9a-f]{{32}}(\.partial|\.link)?$")
    siblings = [p for p in path.parent.iterdir() if pattern.match(p.name)] if path.parent.is_dir() else []
    for sibling in siblings:
        if sibling.is_dir() and not sibling.is_symlink():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            sibling.unlink(missing_ok=True)
