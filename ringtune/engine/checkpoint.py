"""Training checkpoints (weights + optimizer state + step): verified, atomic to save, all-or-nothing to load.

A checkpoint is a directory of torch.distributed.checkpoint (DCP) files plus ``ringtune.json``, the record
with a manifest of every file's size and SHA-256 (:mod:`~ringtune.engine.checkpoint_manifest`), published
atomically under its name (:mod:`~ringtune.engine.checkpoint_layout`); the server keeps them under a
:class:`~ringtune.engine.checkpoint_root.CheckpointRoot`. docs/engine.md has the whole picture.

**Save**: check the name and arguments; one rank prepares the target (a parent that is a file, or a
non-checkpoint at the path, is a UserInputError and nothing is written); DCP writes every rank's share into a
hidden ``.partial`` sibling (replicated tensors once); the ranks hash the files, split between them; one rank
writes the record last and publishes.

**Load** validates everything before it touches the model or the optimizer, in four agreed phases:
1. record and files: the name, ``ringtune.json`` (every field), the file set and sizes against the manifest,
   then the SHA-256 of this rank's share of the files;
2. fit: the DCP metadata against the model (keys, shapes, dtypes) and optimizer (class, parameters,
   hyper-parameter and state names, shapes);
3. read: DCP loads every tensor into *fresh CPU copies* (each rank the whole checkpoint, no communication);
   any error is caught, DCP's ``CheckpointException`` (a BaseException) included, except Ctrl-C/SystemExit
   (re-raised) and out of memory (a server error);
4. commit: only if every rank got through 1-3 are the copies written into the live model and optimizer.
After each phase the ranks agree (:func:`ringtune.parallel.control.agreed_call`): a failure on any rank makes
every rank raise the same :class:`UserInputError` with the model and the optimizer unchanged. Only an error
while copying into live state in phase 4 (out of memory) could leave a partial load (a server error).

Memory of a load: the CPU copies of the model state and, with an optimizer, its state (AdamW: two moments and
a step per parameter): about 3x the parameter bytes of host memory per rank with AdamW, 1x for weights only,
until the load returns; DCP adds a read buffer.

Collectives: over ``group`` (a gloo control group is enough, e.g. a mesh's ``control_group``) or, when it is
None, the default (world) group; every rank of it calls together (with NCCL as the default group, after
``torch.cuda.set_device``). Without an initialised process group: one process. Sharded (FSDP2 / DTensor)
models and optimizers save their shards (DCP writes each chunk once) and load only their shards, from a
checkpoint saved in any layout (templates with the live placements, :mod:`checkpoint_fit`); the caller
reshards FSDP units first (:func:`ringtune.engine.sharding.reshard_all`). Expert-parallel experts are saved as
chunks of global tensors (:mod:`~ringtune.engine.expert_checkpoint`): any EP loads a checkpoint of any EP.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict

from ringtune.engine import expert_checkpoint
from ringtune.engine.checkpoint_fit import OPTIONS, LoadPlan, optimizer_state_dict, plan_load
from ringtune.engine.checkpoint_layout import (
    META_NAME,
    check_name,
    is_complete,
    make_parent,
    prepare_target,
    publish,
    staging_dir,
)
from ringtune.engine.checkpoint_manifest import (
    OPTIM_FRESH,
    OPTIM_NONE,
    OPTIM_SAVED,
    CheckpointRecord,
    FileRecord,
    assign_files,
    check_extra,
    check_file_set,
    data_files,
    hash_file,
    optimizer_class_name,
    parse_record,
    verify_checksums,
)
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import save_hf
from ringtune.models.decoder import CausalLM
from ringtune.parallel.control import NOT_CAUGHT, agreed_call, gather_object_to, run_on_source

T = TypeVar("T")
_MESSAGE_CHARS = 400


def list_checkpoints(root: str | Path) -> list[str]:
    """Names of the complete checkpoints directly under ``root`` (sorted); [] when ``root`` does not exist.

    Complete means sealed (``ringtune.json`` and ``.metadata`` present); contents are not verified here.
    Local filesystem only, no communication.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and is_complete(p))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _control(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group the control collectives use: ``group``, else the world group, else None (one process)."""
    if group is not None:
        return group
    return dist.group.WORLD if _distributed() else None


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _quiet_dcp(call: Callable[[], T]) -> T:
    """Run a DCP call without its warning that no process group means a single process (that is intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return call()


def _cause(exc: BaseException, depth: int = 0) -> str:
    """One line for ``exc``; a CheckpointException as its per-rank causes (its own str is a traceback dump)."""
    if isinstance(exc, CheckpointException) and depth < 3:
        causes = []
        for rank, failure in sorted(exc.failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"rank {rank}: {_cause(inner, depth + 1)}")
        return f"CheckpointException ({'; '.join(causes)})"
    try:
        text = str(exc)
    except Exception:
        text = "<no message>"
    return f"{type(exc).__name__}: {text}"


def _wrapped(exc: BaseException, kinds: tuple[type[BaseException], ...], depth: int = 0) -> BaseException | None:
    """``exc`` or the first exception DCP wrapped into it (a CheckpointException) that is one of ``kinds``."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, CheckpointException) and depth < 3:
        for failure in exc.failures.values():
            found = _wrapped(failure[0] if isinstance(failure, tuple) else failure, kinds, depth + 1)
            if found is not None:
                return found
    return None


def _reraise_interrupt(exc: BaseException) -> None:
    """Raise the KeyboardInterrupt / SystemExit that DCP wrapped into a CheckpointException, if there is one."""
    if (interrupt := _wrapped(exc, NOT_CAUGHT)) is not None:
        raise interrupt


def _describe(exc: BaseException) -> str:
    """``exc`` on one line, cut to a few hundred characters, for an error message."""
    text = " ".join(_cause(exc).split())
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


# --------------------------------------------------------------------------------------------------- save


def _check_save_args(path: Path, step: Any, extra: Any) -> dict[str, Any]:
    check_name(path.name)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UserInputError(f"checkpoint step={step!r}: must be an int >= 0")
    return check_extra(extra)


def _hash_share(directory: Path, control: dist.ProcessGroup | None) -> dict[str, FileRecord] | None:
    """Collective: each rank hashes its share of ``directory``'s files; all records on group rank 0, else None."""
    rank, size = _rank_and_size(control)
    sizes = run_on_source(lambda: data_files(directory), control)
    share = assign_files(sizes, size)[rank]
    mine = agreed_call(lambda: {name: hash_file(directory / name) for name in share}, control)
    parts = gather_object_to(mine, control, dst=0)
    if parts is None:
        return None
    files: dict[str, FileRecord] = {}
    for part in parts:
        files.update(part)
    return files


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Save ``model`` (+ ``optimizer`` state, ``step``, ``extra``) as a verified DCP checkpoint at ``path``, atomically.

    Collective over ``group`` (default: the world group when one is initialised): every rank calls it with its
    (replicated) model and optimizer. Returns on every rank once ``path`` names the new checkpoint. An existing
    checkpoint at ``path`` is replaced; a kill at any moment leaves the old or the new one loadable there. An
    optimizer that has never stepped is recorded as fresh (no moments), so loading it restores an optimizer
    that has not stepped either.

    Args:
        path: the checkpoint; its last component must pass :func:`~ringtune.engine.checkpoint_layout.check_name`.
        model: the module whose state dict is saved (FQN keys).
        optimizer: its optimizer, or None to save weights only.
        step: the training step count (int >= 0) returned by :func:`load_checkpoint`.
        extra: a dict that survives JSON unchanged (or None, stored as {}), returned by :func:`load_checkpoint`.
        group: the process group of the ranks that save together (a gloo group is enough); None: the world.
    Raises:
        UserInputError: on every rank, with nothing written: an invalid name, ``step`` or ``extra``, a parent
            of ``path`` that is not a directory, or something at ``path`` that is not a ringtune checkpoint.
        RuntimeError: a write failed (disk full, I/O error); the partial save is removed, ``path`` unchanged.
    """
    path = Path(path)
    control = _control(group)
    extra = agreed_call(lambda: _check_save_args(path, step, extra), control)
    token = run_on_source(lambda: prepare_target(path), control)
    staging = staging_dir(path, token)

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=OPTIONS)}
        optim_kind, optim_class = OPTIM_NONE, None
    elif not optimizer.state:
        # get_state_dict would initialise the moments with a zero-gradient step (step count 1): keep it fresh.
        state = {"model": get_model_state_dict(model, options=OPTIONS)}
        optim_kind, optim_class = OPTIM_FRESH, optimizer_class_name(optimizer)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
        state = {"model": model_state, "optim": optim_state}
        optim_kind, optim_class = OPTIM_SAVED, optimizer_class_name(optimizer)
    state = expert_checkpoint.globalize(model, state)  # EP shards as chunks of global tensors (identity without EP)

    def write() -> None:
        writer = FileSystemWriter(staging)
        try:
            _quiet_dcp(lambda: dcp.save(state, storage_writer=writer, process_group=group, no_dist=control is None))
        except NOT_CAUGHT:
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            _reraise_interrupt(exc)
            raise RuntimeError(f"checkpoint {path}: writing failed ({_describe(exc)})") from exc

    try:
        agreed_call(write, control)
        files = _hash_share(staging, control)
    except NOT_CAUGHT:
        raise
    except BaseException:
        if _rank_and_size(control)[0] == 0:  # every rank has stopped writing: the verdict was agreed
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _, world_size = _rank_and_size(control)

    def seal() -> None:
        assert files is not None
        record = CheckpointRecord(
            step=step,
            extra=extra,
            optimizer=optim_kind,
            optimizer_class=optim_class,
            world_size=world_size,
            files=files,
        )
        check_file_set(path, staging, files)  # nothing changed between hashing and sealing
        publish(path, staging, record.to_json())

    run_on_source(seal, control)


# --------------------------------------------------------------------------------------------------- load


def _read_record(path: Path, rank: int, size: int) -> tuple[Path, CheckpointRecord]:
    """Phase 1 (this rank): the resolved directory and its checked record; files and this share's hashes verified."""
    check_name(path.name)
    if not path.exists():
        raise UserInputError(f"checkpoint {path} does not exist")
    real = path.resolve()
    if not real.is_dir():
        raise UserInputError(f"checkpoint {path} is not a directory")
    meta_file = real / META_NAME
    if not meta_file.is_file():
        raise UserInputError(f"checkpoint {path} is incomplete or not a ringtune checkpoint: {META_NAME} is missing")
    record = parse_record(path, meta_file.read_bytes())
    check_file_set(path, real, record.files)
    verify_checksums(path, real, record.files, rank, size)
    return real, record


def _plan(path: Path, real: Path, record: CheckpointRecord, model: nn.Module, optimizer) -> LoadPlan:
    """Phase 2 (this rank): the DCP metadata checked against the model and optimizer; what to read."""
    try:
        stored = FileSystemReader(real).read_metadata().state_dict_metadata
    except NOT_CAUGHT:
        raise
    except BaseException as exc:
        raise UserInputError(f"checkpoint {path}: cannot read its DCP metadata ({_describe(exc)})") from None
    return plan_load(path, stored, record, model, optimizer)


@dataclass
class _Staged:
    """Phase 3's result: loaded CPU copies, ready to be committed."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


def _read_copies(
    path: Path, real: Path, plan: LoadPlan, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> _Staged:
    """Phase 3 (this rank): DCP reads every planned entry into the fresh copies of ``plan.template``."""
    try:
        _quiet_dcp(lambda: dcp.load(plan.template, storage_reader=FileSystemReader(real), no_dist=True))
    except NOT_CAUGHT:
        raise
    except BaseException as exc:  # CheckpointException (a BaseException), OSError, unpickling errors, ...
        _reraise_interrupt(exc)
        if _wrapped(exc, (MemoryError, torch.OutOfMemoryError)) is not None:  # the server's fault, not the data's
            raise RuntimeError(f"checkpoint {path}: out of memory while reading ({_describe(exc)})") from exc
        raise UserInputError(
            f"checkpoint {path} could not be read (corrupt, missing or foreign data): {_describe(exc)}"
        ) from None
    expert_checkpoint.localize(model, plan.template)  # EP: each rank read its own experts; keep the local shard
    optim = None
    if plan.restore_optimizer:
        assert optimizer is not None
        optim = optimizer_state_dict(path, plan, optimizer)
    return _Staged(model=plan.template["model"], optimizer=optim)


def _commit(model: nn.Module, optimizer: torch.optim.Optimizer | None, staged: _Staged) -> None:
    """Phase 4: write the copies into the live model and optimizer; drop the gradients."""
    for p in model.parameters():
        p.grad = None
    set_model_state_dict(model, staged.model, options=OPTIONS)
    if optimizer is None:
        return
    if staged.optimizer is None:
        optimizer.state.clear()  # saved fresh: restore an optimizer that has not stepped
    else:
        optimizer.load_state_dict(staged.optimizer)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None = None,
) -> tuple[int, dict]:
    """Restore a :func:`save_checkpoint` checkpoint into ``model`` (and ``optimizer``), all or nothing.

    Collective over ``group`` (default: the world group when one is initialised): every rank calls it and
    loads the full replicated state; any world size loads a checkpoint saved at any other. Everything is
    validated and read into fresh CPU copies first (see the module docstring for the phases and the memory);
    the live state changes only when every rank succeeded. A successful load drops the gradients (None).

    Args:
        path: the checkpoint (its last component must be a valid checkpoint name).
        model: receives the weights (same FQNs, shapes and dtypes as saved).
        optimizer: receives moments, step counts and hyper-parameters (same class and parameters as saved);
            None loads weights only and leaves the optimizer alone.
        group: the process group of the ranks that load together (a gloo group is enough); None: the world.
    Returns:
        (step, extra) as given to :func:`save_checkpoint` (extra None comes back as {}).
    Raises:
        UserInputError: on every rank, naming ``path``, with the model and optimizer unchanged: invalid name,
            missing, incomplete, a bad ``ringtune.json`` field, files that do not match the manifest (missing,
            extra, truncated, corrupt), unreadable DCP data, a different model (keys, shapes, dtypes) or
            optimizer (class, parameters, hyper-parameters), or no optimizer state when ``optimizer`` is given.
    """
    path = Path(path)
    control = _control(group)
    rank, size = _rank_and_size(control)
    real, record = agreed_call(lambda: _read_record(path, rank, size), control)
    plan = agreed_call(lambda: _plan(path, real, record, model, optimizer), control)
    staged = agreed_call(lambda: _read_copies(path, real, plan, model, optimizer), control)
    _commit(model, optimizer, staged)
    return record.step, dict(record.extra)


# --------------------------------------------------------------------------------------------------- export


def export_hf_weights(
    model: CausalLM,
    path: str | Path,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``model`` as an HF checkpoint directory (``save_hf``, atomic) for sampling, its floating tensors in
    ``dtype`` (None: the parameters' own).

    Collective over ``group`` (default: the world group when one is initialised): group rank 0 writes (the
    parameters are replicated), the others wait for it and raise if it failed. ``state``: on group rank 0, the
    whole tensors to write instead of ``model.state_dict()`` (a sharded model's, gathered beforehand).

    Raises:
        UserInputError: on every rank, nothing written: the last component of ``path`` is not a valid
            checkpoint name, or a parent of ``path`` is not a directory.
    """
    path = Path(path)

    def write() -> None:
        check_name(path.name, field="export name")
        make_parent(path)
        save_hf(model, path, dtype=dtype, state=state)

    run_on_source(write, _control(group))
