"""Training checkpoints (weights + optimizer state + step) with torch.distributed.checkpoint, written atomically.

Layout beside a checkpoint named ``name`` in directory ``root``::

    root/name                      -> .name.ckpt-<token>   (a relative symlink: the published checkpoint)
    root/.name.ckpt-<token>/       DCP files (``.metadata``, ``__<rank>_0.distcp``) + ``ringtune.json``
    root/.name.ckpt-<token>.partial/   a save in progress (or one killed mid-write)
    root/.name.ckpt-<token>.link   the new symlink, for an instant before it replaces root/name

A save writes every rank's shard into a fresh ``.partial`` sibling, renames it to its final hidden name once
complete, and then (global rank 0 only) points ``root/name`` at it by atomically replacing the symlink.
Whenever the process is killed, ``root/name`` names either the previous complete checkpoint or the new
complete one; leftovers of interrupted saves are removed by the next successful save of the same name.
One writer per name at a time; do not save and load the same name concurrently.

Model and optimizer state go through :func:`get_state_dict` / :func:`set_state_dict` with a flattened
optimizer state dict, so moments are keyed by parameter FQN (``optim.state.<fqn>.exp_avg``), never by
parameter id. Parameters are replicated (every rank holds the same full tensors); DCP deduplicates the
replicas on save, so a checkpoint holds one copy and loads on any world size.

Every public function here that talks over torch.distributed talks over the default (world) group, and
every rank of it must call the function together (with NCCL, after ``torch.cuda.set_device``, as DCP
requires); without an initialised process group they run as a single process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import save_hf
from ringtune.models.decoder import CausalLM

FORMAT = "ringtune.dcp/1"
META_NAME = "ringtune.json"
DCP_METADATA = ".metadata"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# ``optimizer`` field of ringtune.json: state saved, optimizer had no state yet (never stepped), or none given.
OPTIM_SAVED, OPTIM_FRESH, OPTIM_NONE = "saved", "fresh", "none"
_SHOWN = 8  # names listed in an error message

T = TypeVar("T")


# --------------------------------------------------------------------------------------------------- paths


def _hidden_re(name: str) -> re.Pattern[str]:
    """Sibling entries that belong to checkpoint ``name`` (published versions, partial saves, temp links)."""
    return re.compile(rf"^\.{re.escape(name)}\.ckpt-[0-9a-f]{{32}}(\.partial|\.link)?$")


def _is_complete(directory: Path) -> bool:
    return (directory / META_NAME).is_file() and (directory / DCP_METADATA).is_file()


def list_checkpoints(root: str | Path) -> list[str]:
    """Names of the complete checkpoints directly under ``root`` (sorted); [] when ``root`` does not exist.

    Local filesystem only, no communication.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and _is_complete(p))


# --------------------------------------------------------------------------------------------------- collectives


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank 0 only and give its result to every rank (broadcast over the world group).

    If ``fn`` raises on rank 0, every rank raises: rank 0 its own exception, the others a UserInputError
    (when rank 0's was one) or RuntimeError carrying rank 0's message. Doubles as a barrier.
    """
    if not _distributed():
        return fn()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn())
        except BaseException as exc:
            error = exc
            box[0] = (False, (isinstance(exc, UserInputError), f"{type(exc).__name__}: {exc}"))
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if error is not None:
        raise error
    if not ok:
        user, message = value
        raise (UserInputError if user else RuntimeError)(f"on rank 0: {message}")
    return value


def _agreed_error(error: str | None) -> str | None:
    """The first rank's error if any rank found one, on every rank (all-gather over the world group)."""
    errors = [error]
    if _distributed():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    found = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not found:
        return None
    rank, message = found[0]
    return message if len(errors) == 1 else f"{message} (found on rank {rank})"


def _quiet_dcp(call: Callable[[], T]) -> T:
    """Run a DCP call without its warning that no process group means a single process (that is intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return call()


# --------------------------------------------------------------------------------------------------- save


def _prepare_target(path: Path) -> str:
    """Rank 0: create the parent, refuse to replace something that is not a checkpoint; the save's token."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_symlink() and not (path.is_dir() and _is_complete(path)):
        raise UserInputError(f"checkpoint path {path} exists and is not a ringtune checkpoint; refusing to replace it")
    return uuid.uuid4().hex


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(path: Path, keep: str) -> None:
    """Delete every hidden sibling of checkpoint ``path`` except the published version ``keep``."""
    pattern = _hidden_re(path.name)
    for entry in path.parent.iterdir():
        if entry.name != keep and pattern.match(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _publish(path: Path, staging: Path, meta: dict[str, Any]) -> None:
    """Rank 0: seal ``staging`` (write ringtune.json, rename to its final name) and point ``path`` at it."""
    meta_file = staging / META_NAME
    with open(meta_file, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    final = staging.with_name(staging.name.removesuffix(".partial"))
    os.replace(staging, final)
    link = final.with_name(final.name + ".link")
    os.symlink(final.name, link)  # relative: the root directory can move
    if path.exists() and not path.is_symlink():
        # A real checkpoint directory (copied in by hand): move it aside first. Only here is there a moment
        # without anything at ``path``; a kill then leaves the old version under its hidden name.
        os.replace(path, path.with_name(f".{path.name}.ckpt-{uuid.uuid4().hex}"))
    os.replace(link, path)  # atomic: ``path`` is the old or the new version, never neither
    _fsync_dir(path.parent)
    _remove_stale(path, keep=final.name)


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict | None = None,
) -> None:
    """Save ``model`` (+ ``optimizer`` state, ``step``, ``extra``) as a DCP checkpoint at ``path``, atomically.

    Collective over the world group when one is initialised: every rank calls it with its (replicated)
    model and optimizer; DCP writes one copy of each tensor across the ranks. Returns on every rank once
    ``path`` names the new checkpoint. An existing checkpoint at ``path`` is replaced; a kill at any
    moment leaves the old or the new one loadable there.

    An optimizer that has never stepped is recorded as fresh (no moments), so loading it restores an
    optimizer that has not stepped either.

    Args:
        path: the checkpoint directory (a symlink to a hidden versioned sibling, see the module docstring).
        model: the module whose ``state_dict`` is saved (FQN keys).
        optimizer: its optimizer, or None to save weights only.
        step: the training step count (>= 0) returned by :func:`load_checkpoint`.
        extra: JSON-serialisable metadata returned by :func:`load_checkpoint` (rank 0's copy is kept).
    Raises:
        UserInputError: ``step`` negative, ``extra`` not JSON-serialisable, or ``path`` holds something
            that is not a ringtune checkpoint; nothing is written then.
    """
    path = Path(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UserInputError(f"checkpoint step={step!r}: must be an int >= 0")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"checkpoint extra={extra!r}: must be JSON-serialisable ({exc})") from None
    token = _on_rank0(lambda: _prepare_target(path))
    staging = path.with_name(f".{path.name}.ckpt-{token}.partial")

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=OPTIONS)}
        optim_kind = OPTIM_NONE
    elif not optimizer.state:
        # get_state_dict would initialise the moments with a zero-gradient step (step count 1): keep it fresh.
        state = {"model": get_model_state_dict(model, options=OPTIONS)}
        optim_kind = OPTIM_FRESH
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
        state = {"model": model_state, "optim": optim_state}
        optim_kind = OPTIM_SAVED
    _quiet_dcp(lambda: dcp.save(state, storage_writer=FileSystemWriter(staging), no_dist=not _distributed()))

    world = dist.get_world_size() if _distributed() else 1
    meta = {"format": FORMAT, "step": step, "extra": extra, "optimizer": optim_kind, "world_size": world}
    _on_rank0(lambda: _publish(path, staging, meta))


# --------------------------------------------------------------------------------------------------- load


def _read_meta(path: Path) -> tuple[Path, dict[str, Any]]:
    """The resolved checkpoint directory and its ringtune.json; UserInputError if missing or incomplete."""
    if not path.exists():
        raise UserInputError(f"checkpoint {path} does not exist")
    real = path.resolve()
    if not real.is_dir():
        raise UserInputError(f"checkpoint {path} is not a directory")
    if not _is_complete(real):
        raise UserInputError(
            f"checkpoint {path} is incomplete or not a ringtune checkpoint ({META_NAME} or {DCP_METADATA} missing)"
        )
    try:
        meta = json.loads((real / META_NAME).read_text())
    except json.JSONDecodeError as exc:
        raise UserInputError(f"checkpoint {path}: {META_NAME} is not valid JSON ({exc})") from None
    if meta.get("format") != FORMAT:
        raise UserInputError(f"checkpoint {path}: format {meta.get('format')!r}, this ringtune reads {FORMAT!r}")
    return real, meta


def _tensor_entries(metadata: dict[str, Any], prefix: str) -> dict[str, TensorStorageMetadata]:
    return {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}


def _check_tensors(path: Path, what: str, stored: dict[str, Any], wanted: dict[str, torch.Tensor]) -> str | None:
    """Why the ``stored`` entries (DCP metadata) do not fit the ``wanted`` tensors, or None if they do."""
    missing = sorted(set(wanted) - set(stored))
    unknown = sorted(set(stored) - set(wanted))
    if missing or unknown:
        return (
            f"checkpoint {path} is for a different model: {what} missing {missing[:_SHOWN]} "
            f"({len(missing)} in all), unexpected {unknown[:_SHOWN]} ({len(unknown)} in all)"
        )
    for name, tensor in wanted.items():
        entry = stored[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"checkpoint {path}: {what} {name} is not a tensor in the checkpoint"
        if tuple(entry.size) != tuple(tensor.shape) or entry.properties.dtype != tensor.dtype:
            return (
                f"checkpoint {path} is for a different model: {what} {name} is {entry.properties.dtype} "
                f"{tuple(entry.size)}, this one needs {tensor.dtype} {tuple(tensor.shape)}"
            )
    return None


def _param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor] | str:
    """FQN -> parameter for every parameter of ``optimizer``, or an error if one is not in ``model``."""
    names = {id(p): n for n, p in model.named_parameters()}
    params: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                return f"optimizer holds a parameter of shape {tuple(p.shape)} that is not in the model"
            params[names[id(p)]] = p
    return params


def _check_optimizer_entries(
    path: Path, meta: dict[str, Any], stored: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> str | None:
    """Before touching the optimizer: does the checkpoint's optimizer state fit its parameters?"""
    if meta["optimizer"] == OPTIM_NONE:
        return f"checkpoint {path} has no optimizer state (saved without one); load it with optimizer=None"
    params = _param_fqns(model, optimizer)
    if isinstance(params, str):
        return f"checkpoint {path}: {params}"
    if meta["optimizer"] == OPTIM_FRESH:
        return None
    # Flattened keys: state.<fqn>.<state name> and param_groups.<fqn>.<hyper-parameter>; the last part has no dot.
    grouped = {k.removeprefix("param_groups.").rsplit(".", 1)[0] for k in stored if k.startswith("param_groups.")}
    if grouped != set(params):
        missing, unknown = sorted(set(params) - grouped), sorted(grouped - set(params))
        return (
            f"checkpoint {path}: optimizer parameters differ: missing {missing[:_SHOWN]}, unexpected {unknown[:_SHOWN]}"
        )
    for key, entry in stored.items():
        if not key.startswith("state."):
            continue
        fqn = key.removeprefix("state.").rsplit(".", 1)[0]
        if fqn not in params:
            return f"checkpoint {path}: optimizer state {key} is for a parameter this model does not have"
        if isinstance(entry, TensorStorageMetadata) and len(entry.size) > 0:
            if tuple(entry.size) != tuple(params[fqn].shape):
                return (
                    f"checkpoint {path}: optimizer state {key} has shape {tuple(entry.size)}, "
                    f"parameter {fqn} is {tuple(params[fqn].shape)}"
                )
    return None


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, dict]:
    """Restore a :func:`save_checkpoint` checkpoint into ``model`` (and ``optimizer``) in place.

    Collective over the world group when one is initialised (every rank calls it; each loads the full
    replicated state); any world size may load a checkpoint saved at any other. The checkpoint is first
    validated against the model and optimizer on every rank; if it does not fit on any rank, every rank
    raises and neither the model nor the optimizer is changed. A successful load drops the gradients (None).

    Args:
        path: the checkpoint directory.
        model: receives the weights (same FQNs, shapes and dtypes as saved).
        optimizer: receives moments, step counts and hyper-parameters; None loads weights only and leaves
            the optimizer alone (a fresh optimizer then starts with fresh moments).
    Returns:
        (step, extra) as given to :func:`save_checkpoint` (extra None comes back as {}).
    Raises:
        UserInputError: naming ``path``, when it is missing, incomplete, for a different model (keys,
            shapes or dtypes), or has no optimizer state but ``optimizer`` is given.
    """
    path = Path(path)
    error: str | None = None
    real: Path | None = None
    meta: dict[str, Any] = {}
    stored: dict[str, Any] = {}
    model_state = get_model_state_dict(model, options=OPTIONS)
    try:
        real, meta = _read_meta(path)
        stored = FileSystemReader(real).read_metadata().state_dict_metadata
    except UserInputError as exc:
        error = str(exc)
    except Exception as exc:  # an unreadable .metadata is an incomplete checkpoint too
        error = f"checkpoint {path}: cannot read its DCP metadata ({type(exc).__name__}: {exc})"
    if error is None:
        error = _check_tensors(path, "model tensor", _tensor_entries(stored, "model."), model_state)
    if error is None and optimizer is not None:
        error = _check_optimizer_entries(path, meta, _tensor_entries(stored, "optim."), model, optimizer)
    if (error := _agreed_error(error)) is not None:
        raise UserInputError(error)
    assert real is not None

    state: dict[str, Any] = {"model": model_state}
    restore_optimizer = optimizer is not None and meta["optimizer"] == OPTIM_SAVED
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None  # get_state_dict initialises a fresh optimizer's state (to load into) only without grads
    if restore_optimizer:
        assert optimizer is not None
        was_fresh = not optimizer.state
        model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
        # The template now has the optimizer's own state names (exp_avg, step, ...): they must match too.
        error = _check_tensors(path, "optimizer entry", _tensor_entries(stored, "optim."), optim_state)
        if (error := _agreed_error(error)) is not None:
            if was_fresh:
                optimizer.state.clear()  # undo the initialisation (a zero step at lr 0 left the weights alone)
            for p, grad in grads:
                p.grad = grad
            raise UserInputError(error)
        state = {"model": model_state, "optim": optim_state}

    _quiet_dcp(lambda: dcp.load(state, storage_reader=FileSystemReader(real), no_dist=not _distributed()))
    if restore_optimizer:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS
        )
    else:
        set_model_state_dict(model, state["model"], options=OPTIONS)
        if optimizer is not None:
            optimizer.state.clear()  # saved fresh: restore an optimizer that has not stepped
    return int(meta["step"]), meta["extra"] or {}


# --------------------------------------------------------------------------------------------------- export


def export_hf_weights(model: CausalLM, path: str | Path) -> None:
    """Write ``model`` as an HF checkpoint directory (``save_hf``, atomic) for sampling.

    Collective over the world group when one is initialised: global rank 0 writes (the parameters are
    replicated), the others wait for it and raise if it failed.
    """
    _on_rank0(lambda: save_hf(model, path))
