"""Does a checkpoint's DCP metadata fit a model and optimizer? Fresh CPU tensors to load it into, and back.

A checkpoint's DCP keys are ``model.<fqn>`` (the model state dict) and, for the optimizer, the flattened
optimizer state dict of ``get_state_dict(..., flatten_optimizer_state_dict=True)``:
``optim.state.<fqn>.<state name>`` (tensors: ``exp_avg``, ``exp_avg_sq``, ``step`` for AdamW) and
``optim.param_groups.<fqn>.<hyper-parameter>`` (pickled Python values: ``lr``, ``betas``, ...). Moments are
keyed by parameter FQN, never by parameter id, so any model with the same FQNs, shapes and dtypes loads them.

Sharded (FSDP2 / DTensor) models and optimizers fit the same way (the metadata holds global sizes); their
templates are DTensors with the live placements, so each rank reads its shard only (:func:`_empty`); so do
expert-parallel experts, seen as global DTensors (:mod:`ringtune.engine.expert_checkpoint`).

Nothing here changes the model or the optimizer: :func:`plan_load` reads shapes, dtypes and names only, and
:func:`optimizer_state_dict` builds a new state dict for ``optimizer.load_state_dict`` from loaded copies.
Local work, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from ringtune.engine import expert_checkpoint
from ringtune.engine.checkpoint_manifest import (
    OPTIM_FRESH,
    OPTIM_NONE,
    OPTIM_SAVED,
    CheckpointRecord,
    names_mismatch,
    optimizer_class_name,
)
from ringtune.errors import UserInputError

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_GROUP_KEYS = ("params", "param_names")
"""Keys of an optimizer param group that are not hyper-parameters."""
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Keys of a param group that say how the update runs (the trainer's AdamW kernel, ``ADAMW_KERNELS``), not what
the run learned: the live optimizer's are kept on load (a checkpoint of either kernel resumes under the other)."""
_SHOWN = 8


@dataclass
class LoadPlan:
    """What to read and how to give it back: the template DCP fills, and the optimizer's parameter order.

    Attributes:
        template: ``{"model": {fqn: empty CPU tensor}, "optim": {flat key: empty CPU tensor or None}}``; the
            ``optim`` part only when optimizer state is restored. Shapes and dtypes are the checkpoint's.
        fqns: the optimizer's parameters in ``param_groups`` order (empty without an optimizer).
        state_names: per FQN, the optimizer state names stored for it (none for a parameter never stepped).
        restore_optimizer: whether moments are loaded (else a given optimizer is reset to fresh).
    """

    template: dict[str, dict[str, Any]]
    fqns: list[str] = field(default_factory=list)
    state_names: dict[str, list[str]] = field(default_factory=dict)
    restore_optimizer: bool = False


def entries(stored: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The DCP metadata entries under ``prefix`` (e.g. ``model.``), keyed without it."""
    return {k[len(prefix) :]: v for k, v in stored.items() if k.startswith(prefix)}


def _covered(entry: TensorStorageMetadata) -> bool:
    """Whether the stored chunks of a tensor lie inside it and add up to all of it (no unwritten element)."""
    size = tuple(entry.size)
    total = 0
    for chunk in entry.chunks:
        if len(chunk.offsets) != len(size) or any(
            o < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, size, strict=True)
        ):
            return False
        total += math.prod(chunk.sizes)
    return total == math.prod(size)


def _check_model(path: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """The ``model.`` entries have exactly the model's keys, shapes and dtypes; UserInputError if not."""
    missing = sorted(set(wanted) - set(stored))
    unknown = sorted(set(stored) - set(wanted))
    if missing or unknown:
        mismatch = names_mismatch(missing, "model tensors missing", unknown, "unexpected")
        raise UserInputError(f"checkpoint {path} is for a different model: {mismatch}")
    for name, tensor in wanted.items():
        entry = stored[name]
        if not isinstance(tensor, torch.Tensor):
            raise UserInputError(f"checkpoint {path}: model entry {name} is not a tensor in this model")
        if not isinstance(entry, TensorStorageMetadata):
            raise UserInputError(f"checkpoint {path}: model tensor {name} is not a tensor in the checkpoint")
        if tuple(entry.size) != tuple(tensor.shape) or entry.properties.dtype != tensor.dtype:
            raise UserInputError(
                f"checkpoint {path} is for a different model: model tensor {name} is {entry.properties.dtype} "
                f"{tuple(entry.size)}, this one needs {tensor.dtype} {tuple(tensor.shape)}"
            )
        if not _covered(entry):
            raise UserInputError(f"checkpoint {path}: the stored chunks of model tensor {name} do not cover it")


def _param_fqns(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """FQN of every parameter of ``optimizer`` in param_groups order; UserInputError if one is not in ``model``."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise UserInputError(
                    f"checkpoint {path}: the optimizer holds a parameter of shape {tuple(p.shape)} "
                    "that is not in the model"
                )
            fqns.append(names[id(p)])
    return fqns


def _check_optimizer(
    path: Path,
    record: CheckpointRecord,
    stored: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[list[str], dict[str, list[str]]]:
    """Does the stored optimizer state (``optim.`` entries, without the prefix) fit ``optimizer``?

    Returns the optimizer's FQNs in order and the stored state names per FQN; raises UserInputError naming
    the first mismatch: no state saved, another optimizer class, other parameters, other hyper-parameter
    names, other state names than the optimizer already holds, or moments of another shape.
    """
    if record.optimizer == OPTIM_NONE:
        raise UserInputError(
            f"checkpoint {path} has no optimizer state (saved without one); load it with optimizer=None"
        )
    wanted_class = optimizer_class_name(optimizer)
    if record.optimizer_class != wanted_class:
        raise UserInputError(
            f"checkpoint {path} is for a different optimizer: it holds {record.optimizer_class} state, "
            f"this optimizer is {wanted_class}"
        )
    fqns = _param_fqns(path, model, optimizer)
    if record.optimizer == OPTIM_FRESH:
        if stored:
            raise UserInputError(f"checkpoint {path}: recorded as a fresh optimizer but holds optimizer entries")
        return fqns, {}
    hyper: dict[str, set[str]] = {}
    state: dict[str, dict[str, Any]] = {}
    for key, entry in stored.items():
        section, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if section == "param_groups":
            names = hyper.setdefault(fqn, set())
            if name not in _GROUP_KEYS:  # ``param_names`` (optimizers built from named_parameters) is no setting
                names.add(name)
        elif section == "state":
            state.setdefault(fqn, {})[name] = entry
        else:
            raise UserInputError(f"checkpoint {path}: unknown optimizer entry {key!r}")
    if set(hyper) != set(fqns) or not set(state) <= set(fqns):
        missing = sorted(set(fqns) - set(hyper))
        unknown = sorted((set(hyper) | set(state)) - set(fqns))
        mismatch = names_mismatch(missing, "optimizer parameters missing", unknown, "unexpected")
        raise UserInputError(f"checkpoint {path} is for a different model: {mismatch}")
    params = dict(zip(fqns, (p for g in optimizer.param_groups for p in g["params"]), strict=True))
    names_of = {id(p): n for n, p in params.items()}
    shapes = {fqn: tuple(p.shape) for fqn, p in params.items()}
    shapes.update({fqn: tuple(p.shape) for fqn, p in expert_checkpoint.global_params(model).items()})
    for group in optimizer.param_groups:
        live = sorted(k for k in group if k not in _GROUP_KEYS)
        for p in group["params"]:
            fqn = names_of[id(p)]
            if sorted(hyper[fqn]) != live:
                raise UserInputError(
                    f"checkpoint {path}: optimizer hyper-parameters of {fqn} are {sorted(hyper[fqn])}, "
                    f"this optimizer has {live}"
                )
    for fqn, stored_state in state.items():
        held = optimizer.state.get(params[fqn])
        if held and sorted(held) != sorted(stored_state):
            raise UserInputError(
                f"checkpoint {path}: optimizer state of {fqn} is {sorted(stored_state)}, "
                f"this optimizer holds {sorted(held)}"
            )
        for name, entry in stored_state.items():
            if not isinstance(entry, TensorStorageMetadata):
                continue
            if len(entry.size) > 0 and tuple(entry.size) != shapes[fqn]:
                raise UserInputError(
                    f"checkpoint {path} is for a different model: optimizer state {fqn}.{name} has shape "
                    f"{tuple(entry.size)}, parameter {fqn} is {shapes[fqn]}"
                )
            if not _covered(entry):
                raise UserInputError(f"checkpoint {path}: the stored chunks of optimizer state {fqn}.{name} are short")
    return fqns, {fqn: sorted(s) for fqn, s in state.items()}


def _empty(entry: Any, like: Any = None) -> torch.Tensor | None:
    """An uninitialised tensor for a stored tensor (DCP writes every element), None for a pickled value.

    A CPU tensor of the stored size and dtype; when the live tensor ``like`` is a DTensor (FSDP-sharded) of the
    stored size, a DTensor on its mesh with its placements whose local shard is fresh (on ``like``'s device):
    DCP then reads only this rank's shard, whatever layout the checkpoint was saved in.
    """
    if isinstance(entry, TensorStorageMetadata):
        size, dtype = tuple(entry.size), entry.properties.dtype
        if isinstance(like, DTensor) and tuple(like.shape) == size:
            local = torch.empty(like.to_local().shape, dtype=dtype, device=like.to_local().device)
            return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
        return torch.empty(size, dtype=dtype, device="cpu")  # read on the host, copied into the live tensor
    if isinstance(entry, BytesStorageMetadata):
        return None
    raise UserInputError(f"unsupported DCP entry type {type(entry).__name__}")


def plan_load(
    path: Path,
    stored: dict[str, Any],
    record: CheckpointRecord,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> LoadPlan:
    """Check the DCP metadata ``stored`` (all keys) against ``model`` (+ ``optimizer``); the load plan.

    Raises UserInputError naming ``path`` and the first mismatch (see :func:`_check_optimizer`); also when the
    record and the DCP entries disagree about optimizer state. Reads shapes and names only.
    """
    stored_optim = entries(stored, "optim.")
    if (record.optimizer == OPTIM_SAVED) != bool(stored_optim):
        raise UserInputError(
            f"checkpoint {path}: its record says optimizer={record.optimizer!r} but it holds "
            f"{len(stored_optim)} optimizer entries"
        )
    stored_model = entries(stored, "model.")
    if len(stored_model) + len(stored_optim) != len(stored):
        unknown = sorted(k for k in stored if not k.startswith(("model.", "optim.")))
        raise UserInputError(f"checkpoint {path}: unknown entries {unknown[:_SHOWN]}")
    live = expert_checkpoint.globalize(model, {"model": get_model_state_dict(model, options=OPTIONS)})["model"]
    _check_model(path, stored_model, live)
    plan = LoadPlan(template={"model": {k: _empty(v, live[k]) for k, v in stored_model.items()}})
    if optimizer is None:
        return plan
    plan.fqns, plan.state_names = _check_optimizer(path, record, stored_optim, model, optimizer)
    plan.restore_optimizer = record.optimizer == OPTIM_SAVED
    if plan.restore_optimizer:
        params = dict(zip(plan.fqns, (p for g in optimizer.param_groups for p in g["params"]), strict=True))
        params.update(expert_checkpoint.global_params(model))  # EP experts: global DTensors, local templates
        plan.template["optim"] = {
            k: _empty(v, _state_param(k, params))
            for k, v in stored_optim.items()
            if k.rpartition(".")[2] not in _GROUP_KEYS
        }
    return plan


def _state_param(key: str, params: dict[str, torch.nn.Parameter]) -> torch.nn.Parameter | None:
    """The parameter an ``optim.`` key (without the prefix) belongs to: ``state.<fqn>.<name>``; None otherwise."""
    section, _, rest = key.partition(".")
    return params.get(rest.rpartition(".")[0]) if section == "state" else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def optimizer_state_dict(path: Path, plan: LoadPlan, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The loaded optimizer copies (``plan.template["optim"]``) as a state dict for ``optimizer.load_state_dict``.

    Parameter ids and group layout are the live optimizer's, and so is its kernel (:data:`_KERNEL_KEYS`);
    hyper-parameters come from the checkpoint and must be the same for every parameter of one live group (else
    UserInputError: the group layouts differ).
    """
    loaded = plan.template["optim"]
    live = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for live_group, group in zip(live["param_groups"], optimizer.param_groups, strict=True):
        group_fqns = plan.fqns[index : index + len(group["params"])]
        hyper = {}
        if group_fqns:
            first = group_fqns[0]
            names = [k for k in live_group if k not in _GROUP_KEYS and k not in _KERNEL_KEYS]
            hyper = {k: loaded[f"param_groups.{first}.{k}"] for k in names}
            for fqn in group_fqns[1:]:
                for k in names:
                    value = loaded[f"param_groups.{fqn}.{k}"]
                    if not _same(value, hyper[k]):
                        raise UserInputError(
                            f"checkpoint {path}: optimizer hyper-parameter {k} is {hyper[k]!r} for {first} but "
                            f"{value!r} for {fqn}; the optimizer's param groups differ from the checkpoint's"
                        )
        groups.append({**live_group, **hyper})
        for i, fqn in enumerate(group_fqns):
            names = plan.state_names.get(fqn, [])
            if names:
                state[index + i] = {name: loaded[f"state.{fqn}.{name}"] for name in names}
        index += len(group["params"])
    return {"state": state, "param_groups": groups}
