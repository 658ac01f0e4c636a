"""How one named training checkpoint sits on disk: the name rule, versions, staging, publishing, removal.

Layout beside a checkpoint named ``name`` in directory ``parent``::

    parent/name                        -> .name.ckpt-<token>   (a relative symlink: the published checkpoint)
    parent/.name.ckpt-<token>/         DCP files (``.metadata``, ``__<rank>_<i>.distcp``) + ``ringtune.json``
    parent/.name.ckpt-<token>.partial/ a save in progress (or one killed mid-write)
    parent/.name.ckpt-<token>.link     the new symlink, for an instant before it replaces parent/name

``<token>`` is 32 hex digits (a uuid4). Hidden names (a leading ``.``) are reserved for these versions and for
staging, which is why a checkpoint name may not start with ``.`` (see :func:`check_name`). A save writes into a
``.partial`` sibling, renames it to its final hidden name once sealed, then points ``parent/name`` at it by
atomically replacing the symlink: whenever the process is killed, ``parent/name`` names either the previous
complete version or the new one. Leftovers of interrupted saves are removed by the next successful save of the
same name (or by :func:`remove_checkpoint`). One writer per name at a time.

Everything here is local filesystem work in the calling process; no communication.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from ringtune.errors import UserInputError

META_NAME = "ringtune.json"
DCP_METADATA = ".metadata"

NAME_CHARS = "A-Za-z0-9._:-"
"""The characters a checkpoint name or run id may contain (ASCII letters, digits, ``. _ : -``)."""
NAME_MAX = 128
"""Longest checkpoint name; its hidden versions (``.<name>.ckpt-<32 hex>.partial``) stay under 255 bytes."""
RUN_ID_MAX = 255
"""Longest run id (one directory name)."""
_NAME_CHAR = re.compile(rf"[{NAME_CHARS}]")
_SHOWN_CHARS = 60


def _shown(value: object) -> str:
    """``repr(value)``, cut for long strings (control characters stay escaped, so a message stays one line)."""
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"
    return repr(value)


def check_name(value: object, *, field: str = "checkpoint name", max_len: int = NAME_MAX) -> str:
    """``value`` if it is a valid checkpoint name (or run id, with ``max_len=RUN_ID_MAX``); else UserInputError.

    The rule: a str of 1..``max_len`` characters from ``[A-Za-z0-9._:-]`` that does not start with ``.``. That
    excludes ``.`` and ``..``, hidden (staging) names, ``/`` and ``\\``, whitespace, NUL and every control
    character, so a valid name is one path component that stays where it is joined. The message names
    ``field``, the value (escaped, cut when long), what is wrong and the rule.
    """
    problem = None
    if not isinstance(value, str):
        problem = f"is a {type(value).__name__}, not a str"
    elif not value:
        problem = "is empty"
    elif len(value) > max_len:
        problem = f"has {len(value)} characters"
    elif value.startswith("."):
        problem = "starts with '.' (hidden names are reserved for staging)"
    else:
        for i, char in enumerate(value):
            if not _NAME_CHAR.fullmatch(char):
                problem = f"contains {char!r} at index {i}"
                break
    if problem is not None:
        raise UserInputError(
            f"{field}={_shown(value)} {problem}; allowed: 1 to {max_len} characters from [{NAME_CHARS}], "
            "not starting with '.'"
        )
    return value


def version_pattern(name: str) -> re.Pattern[str]:
    """Hidden entries beside checkpoint ``name``: its published versions, partial saves and temporary links."""
    return re.compile(rf"^\.{re.escape(name)}\.ckpt-[0-9a-f]{{32}}(\.partial|\.link)?$")


def staging_dir(path: Path, token: str) -> Path:
    """Where the save with ``token`` of checkpoint ``path`` writes before it is sealed."""
    return path.with_name(f".{path.name}.ckpt-{token}.partial")


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` (or the version a symlink names) holds a sealed checkpoint (cheap: two stats)."""
    return (directory / META_NAME).is_file() and (directory / DCP_METADATA).is_file()


def make_parent(path: Path) -> None:
    """Create ``path``'s parent directories; UserInputError naming the ancestor if one is not a directory."""
    for ancestor in reversed(path.parents):  # from the filesystem root down to the parent
        if not os.path.lexists(ancestor):
            break
        if not ancestor.is_dir():
            raise UserInputError(f"checkpoint path {path}: {ancestor} exists and is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # raced with something that created a file there
        raise UserInputError(f"checkpoint path {path}: a parent is not a directory ({exc})") from None


def prepare_target(path: Path) -> str:
    """Before a save (one process): create the parent, refuse to replace a non-checkpoint; the save's token.

    Raises:
        UserInputError: a parent is a file, or ``path`` holds something that is not a ringtune checkpoint.
    """
    make_parent(path)
    if os.path.lexists(path) and not path.is_symlink() and not (path.is_dir() and is_complete(path)):
        raise UserInputError(f"checkpoint path {path} exists and is not a ringtune checkpoint; refusing to replace it")
    return uuid.uuid4().hex


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (creations, renames) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_versions(path: Path, keep: str | None) -> None:
    """Delete every hidden sibling of checkpoint ``path`` (versions, partial saves, links) except ``keep``."""
    pattern = version_pattern(path.name)
    for entry in path.parent.iterdir():
        if entry.name != keep and pattern.match(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def publish(path: Path, staging: Path, record: str) -> None:
    """Seal ``staging`` (write ``record`` as ringtune.json, rename to its final name), point ``path`` at it.

    One process only. The record is written last, after every data file, and fsynced with its directory.
    """
    meta_file = staging / META_NAME
    with open(meta_file, "w") as f:
        f.write(record)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)
    final = staging.with_name(staging.name.removesuffix(".partial"))
    os.replace(staging, final)
    link = final.with_name(final.name + ".link")
    os.symlink(final.name, link)  # relative: the root directory can move
    if path.exists() and not path.is_symlink():
        # A real checkpoint directory (copied in by hand): move it aside first. Only here is there a moment
        # without anything at ``path``; a kill then leaves the old version under its hidden name.
        os.replace(path, path.with_name(f".{path.name}.ckpt-{uuid.uuid4().hex}"))
    os.replace(link, path)  # atomic: ``path`` is the old or the new version, never neither
    fsync_dir(path.parent)
    remove_versions(path, keep=final.name)


def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint ``path`` and all its versions; ``path`` disappears first, in one step.

    The symlink is unlinked (a real directory is first renamed to a hidden version), so a concurrent
    listing never sees a half-deleted checkpoint; then every hidden version is removed.
    """
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        os.replace(path, path.with_name(f".{path.name}.ckpt-{uuid.uuid4().hex}"))
    fsync_dir(path.parent)
    remove_versions(path, keep=None)


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step stored in the training checkpoint at ``path`` (its ``ringtune.json``)."""
    return int(json.loads((Path(path).resolve() / META_NAME).read_text())["step"])
