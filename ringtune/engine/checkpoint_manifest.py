"""The record of a training checkpoint (``ringtune.json``): its fields, the file manifest, and their checks.

``ringtune.json`` is written last, after every data file, and holds::

    {"format": "ringtune.dcp/2", "step": 12, "extra": {...}, "optimizer": "saved" | "fresh" | "none",
     "optimizer_class": "torch.optim.adamw.AdamW" | null, "world_size": 2,
     "manifest": {"hash": "sha256", "files": {".metadata": {"size": 1234, "sha256": "<64 hex>"}, ...}}}

The manifest lists every other file of the checkpoint directory with its size and SHA-256. SHA-256 runs at
about 1.3 GiB/s per core where the CPU has SHA instructions (x86 SHA-NI, ARMv8 crypto; measured 1.26 GiB/s on
a shared EPYC core, against 0.53 GiB/s for BLAKE2b), so the hashing is spread over the ranks: file ``f`` is
hashed by rank :func:`assign_files` gives it (largest files first, each to the least-loaded rank), on save and
on load alike.

The checks raise :class:`UserInputError` naming the checkpoint, the field, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtune.engine.checkpoint_layout import META_NAME
from ringtune.errors import UserInputError

FORMAT = "ringtune.dcp/2"
"""Version 2 added the manifest; a version-1 checkpoint (no manifest) is refused, to be re-saved."""
HASH = "sha256"
OPTIM_SAVED, OPTIM_FRESH, OPTIM_NONE = "saved", "fresh", "none"
"""``optimizer`` field: state saved; optimizer given but never stepped (no moments); no optimizer given."""
OPTIM_KINDS = (OPTIM_SAVED, OPTIM_FRESH, OPTIM_NONE)
_READ_BYTES = 8 * 2**20
_DIGEST_CHARS = frozenset("0123456789abcdef")
_SHOWN = 8


@dataclass(frozen=True)
class FileRecord:
    """One file of the manifest: its size in bytes and its SHA-256 (64 lowercase hex digits)."""

    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord:
    """The contents of ``ringtune.json`` (see the module docstring)."""

    step: int
    extra: dict[str, Any]
    optimizer: str
    optimizer_class: str | None
    world_size: int
    files: dict[str, FileRecord] = field(default_factory=dict)

    def to_json(self) -> str:
        """The JSON text written as ``ringtune.json``."""
        manifest = {"hash": HASH, "files": {n: {"size": r.size, HASH: r.sha256} for n, r in sorted(self.files.items())}}
        return json.dumps(
            {
                "format": FORMAT,
                "step": self.step,
                "extra": self.extra,
                "optimizer": self.optimizer,
                "optimizer_class": self.optimizer_class,
                "world_size": self.world_size,
                "manifest": manifest,
            },
            indent=2,
        )


def optimizer_class_name(optimizer: object) -> str:
    """``module.QualName`` of the optimizer's class, as recorded (e.g. ``torch.optim.adamw.AdamW``)."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _int_field(path: Path, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"checkpoint {path}: {META_NAME} field {name}={value!r}; must be an int >= {minimum}")
    return value


def _file_record(path: Path, name: Any, entry: Any) -> tuple[str, FileRecord]:
    where = f"checkpoint {path}: {META_NAME} manifest entry {name!r}"
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise UserInputError(f"{where}: not a plain file name (no '/', '\\', NUL, '.' or '..')")
    if name == META_NAME:
        raise UserInputError(f"{where}: the record cannot list itself")
    if not isinstance(entry, dict) or set(entry) != {"size", HASH}:
        raise UserInputError(f"{where} is {entry!r}; must be an object with exactly the keys 'size' and {HASH!r}")
    size = _int_field(path, f"manifest size of {name!r}", entry["size"], 0)
    digest = entry[HASH]
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _DIGEST_CHARS:
        raise UserInputError(f"{where}: {HASH}={digest!r}; must be 64 lowercase hex digits")
    return name, FileRecord(size=size, sha256=digest)


def parse_record(path: Path, text: str | bytes) -> CheckpointRecord:
    """Parse and check the ``ringtune.json`` contents of checkpoint ``path`` (path is only used in messages).

    Checks, in order: JSON object; ``format`` is :data:`FORMAT`; ``step`` an int >= 0; ``extra`` an object;
    ``optimizer`` one of :data:`OPTIM_KINDS`; ``optimizer_class`` a non-empty str unless ``optimizer`` is
    ``none`` (then null); ``world_size`` an int >= 1; ``manifest`` with ``hash`` sha256 and ``files`` mapping
    plain file names to ``{"size": int >= 0, "sha256": 64 hex}``, at least ``.metadata`` listed.
    """
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserInputError(f"checkpoint {path}: {META_NAME} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise UserInputError(f"checkpoint {path}: {META_NAME} is a {type(raw).__name__}; must be a JSON object")
    if raw.get("format") != FORMAT:
        raise UserInputError(
            f"checkpoint {path}: {META_NAME} field format={raw.get('format')!r}; this ringtune reads {FORMAT!r} "
            "(a checkpoint without a manifest must be re-saved)"
        )
    for key in ("step", "extra", "optimizer", "optimizer_class", "world_size", "manifest"):
        if key not in raw:
            raise UserInputError(f"checkpoint {path}: {META_NAME} has no field {key!r}")
    step = _int_field(path, "step", raw["step"], 0)
    extra = raw["extra"]
    if not isinstance(extra, dict):
        raise UserInputError(f"checkpoint {path}: {META_NAME} field extra={extra!r}; must be a JSON object")
    optimizer = raw["optimizer"]
    if optimizer not in OPTIM_KINDS:
        raise UserInputError(
            f"checkpoint {path}: {META_NAME} field optimizer={optimizer!r}; must be one of {OPTIM_KINDS}"
        )
    optimizer_class = raw["optimizer_class"]
    if optimizer == OPTIM_NONE and optimizer_class is not None:
        raise UserInputError(f"checkpoint {path}: {META_NAME} field optimizer_class={optimizer_class!r} without state")
    if optimizer != OPTIM_NONE and (not isinstance(optimizer_class, str) or not optimizer_class):
        raise UserInputError(
            f"checkpoint {path}: {META_NAME} field optimizer_class={optimizer_class!r}; must name the optimizer class"
        )
    world_size = _int_field(path, "world_size", raw["world_size"], 1)
    manifest = raw["manifest"]
    if not isinstance(manifest, dict) or manifest.get("hash") != HASH or not isinstance(manifest.get("files"), dict):
        raise UserInputError(
            f"checkpoint {path}: {META_NAME} field manifest={_cut(manifest)}; "
            f'must be {{"hash": "{HASH}", "files": {{name: {{"size": ..., "{HASH}": ...}}}}}}'
        )
    files = dict(_file_record(path, name, entry) for name, entry in manifest["files"].items())
    if ".metadata" not in files:
        raise UserInputError(f"checkpoint {path}: {META_NAME} manifest does not list .metadata")
    return CheckpointRecord(
        step=step,
        extra=extra,
        optimizer=optimizer,
        optimizer_class=optimizer_class,
        world_size=world_size,
        files=files,
    )


def _cut(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_extra(extra: Any) -> dict[str, Any]:
    """``extra`` (None -> {}) if it is a dict that survives a JSON round trip unchanged; else UserInputError."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise UserInputError(f"checkpoint extra={_cut(extra)}: must be a dict (JSON object) or None")
    try:
        again = json.loads(json.dumps(extra, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"checkpoint extra={_cut(extra)}: must be JSON-serialisable ({exc})") from None
    if again != extra:
        raise UserInputError(
            f"checkpoint extra={_cut(extra)}: does not survive JSON unchanged (keys must be str, no tuples); "
            f"it reads back as {_cut(again)}"
        )
    return extra


# --------------------------------------------------------------------------------------------------- hashing


def hash_file(path: Path) -> FileRecord:
    """Size and SHA-256 of the file at ``path``, read in 8 MiB blocks (see the module docstring for speed)."""
    digest = hashlib.new(HASH)
    size = 0
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return FileRecord(size=size, sha256=digest.hexdigest())


def assign_files(sizes: dict[str, int], ranks: int) -> list[list[str]]:
    """Which rank hashes which file: largest first, each to the least-loaded rank (ties: lowest rank, name order).

    Deterministic in ``sizes``, so every rank computes the same assignment from the same manifest.
    """
    load = [0] * ranks
    shares: list[list[str]] = [[] for _ in range(ranks)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += max(sizes[name], 1)
    return shares


def data_files(directory: Path) -> dict[str, int]:
    """Size of every entry of ``directory`` except ``ringtune.json`` (the manifest's subject), by name."""
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.name != META_NAME}


# --------------------------------------------------------------------------------------------------- verification


def names_mismatch(missing: list[str], missing_what: str, unknown: list[str], unknown_what: str) -> str:
    """``"<missing_what> [first 8 of missing] (N in all), <unknown_what> [first 8 of unknown] (M in all)"``: the
    tail of a checkpoint's "these names differ" error message."""
    return (
        f"{missing_what} {missing[:_SHOWN]} ({len(missing)} in all), "
        f"{unknown_what} {unknown[:_SHOWN]} ({len(unknown)} in all)"
    )


def check_file_set(path: Path, directory: Path, files: dict[str, FileRecord]) -> None:
    """Every file in ``directory`` is in the manifest and vice versa, each a regular file of the listed size.

    ``path`` names the checkpoint in messages. Local: a few stats, no reads.
    """
    present = {p.name: p for p in directory.iterdir() if p.name != META_NAME}
    missing = sorted(set(files) - set(present))
    unknown = sorted(set(present) - set(files))
    if missing or unknown:
        mismatch = names_mismatch(missing, "missing files", unknown, "unlisted files")
        raise UserInputError(f"checkpoint {path} does not match its manifest: {mismatch}")
    for name, record in sorted(files.items()):
        entry = present[name]
        if entry.is_symlink() or not entry.is_file():
            raise UserInputError(f"checkpoint {path}: {name} is not a regular file")
        size = entry.stat().st_size
        if size != record.size:
            raise UserInputError(
                f"checkpoint {path}: {name} has {size} bytes, its manifest says {record.size} "
                "(truncated or overwritten)"
            )


def verify_checksums(path: Path, directory: Path, files: dict[str, FileRecord], rank: int, ranks: int) -> None:
    """Hash this rank's share of the files (:func:`assign_files`) and compare with the manifest.

    Every rank of a group calls it with its own ``rank`` and the same ``files``; together they cover every
    file once. Raises UserInputError naming the first file whose size or SHA-256 differs.
    """
    share = assign_files({n: r.size for n, r in files.items()}, ranks)[rank]
    for name in share:
        found = hash_file(directory / name)
        expected = files[name]
        if found != expected:
            raise UserInputError(
                f"checkpoint {path}: {name} is corrupt: {HASH} {found.sha256[:16]}... over {found.size} bytes, "
                f"the manifest says {expected.sha256[:16]}... over {expected.size} bytes (checked on rank {rank})"
            )
