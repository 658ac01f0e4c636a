"""DCP checkpoints of expert-parallel models: each EP shard of an expert tensor is a chunk of one global tensor.

Under EP (:func:`ringtune.models.layers.moe.set_expert_parallel`) rank r of an EP group of size N holds experts
``[r·E/N, (r+1)·E/N)`` of ``<block>.experts.gate_up_proj`` / ``down_proj`` under the same name on every rank.
A checkpoint presents each such tensor (and its AdamW moments ``exp_avg`` / ``exp_avg_sq``) to DCP as a
``DTensor`` of the **global** shape [E, ...], ``Shard(0)`` over a 1-D ``DeviceMesh`` of the block's EP group:
DCP then writes every expert once (the expert replica groups hold equal chunks at equal offsets: deduplicated)
and the checkpoint has exactly the keys and shapes of an EP = 1 model's. Loading builds DTensor templates over
the live EP group, so each rank reads its own experts only, whatever EP (or none) the checkpoint was saved at.

Under FSDP (``shard_params='dp_cp'``, :mod:`ringtune.engine.expert_sharding`) each rank holds a chunk of its
EP rank's experts; the global DTensor is then ``(Shard(0), Shard(0))`` over the 2-D ``("ep", "expert_replica")``
mesh, with the same keys and shapes.

Contract: the model's MoE blocks all use one EP group (the mesh's); every rank of the checkpoint's control group
calls these functions in the same order (building a block's ``DeviceMesh`` may communicate once per group; it
is cached on the block). Without EP (no block with an EP group of size > 1) every function is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ringtune.models.layers.moe import SparseMoE

_MOMENTS = ("exp_avg", "exp_avg_sq")
"""Optimizer state names shaped like their parameter (AdamW's); ``step`` is a scalar, the same on every rank."""


def _mesh(block: SparseMoE) -> DeviceMesh:
    """A 1-D DeviceMesh over ``block.ep_group``, cached on the block while the group is the same object."""
    cached = getattr(block, "_ep_device_mesh", None)
    if cached is not None and cached[0] is block.ep_group:
        return cached[1]
    device = block.experts.gate_up_proj.device.type
    mesh = DeviceMesh.from_group(block.ep_group, device_type=device)
    block._ep_device_mesh = (block.ep_group, mesh)
    return mesh


def sharded_experts(model: nn.Module) -> dict[str, tuple[torch.nn.Parameter, DeviceMesh]]:
    """{fqn of an expert-parallel expert tensor: (its parameter, the DeviceMesh its global DTensor lies on)}; {}
    without EP. The mesh is the block's EP mesh, or, when FSDP shards the experts over their replica group (the
    parameter is then a DTensor of [E/N, ...]), the 2-D ``("ep", "expert_replica")`` mesh of
    :mod:`ringtune.engine.expert_sharding`."""
    out = {}
    for name, block in model.named_modules():
        if not isinstance(block, SparseMoE) or block.ep_group is None or dist.get_world_size(block.ep_group) == 1:
            continue
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(block.experts, proj)
            mesh = block.expert_global_mesh if isinstance(param, DTensor) else _mesh(block)
            out[f"{name}.experts.{proj}"] = (param, mesh)
    return out


def _global(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``local`` [E/N, ...] (this EP rank's experts) as the DTensor [E, ...] sharded on dim 0 over ``mesh``; an
    FSDP-sharded one (a DTensor: its chunk of the E/N over the replica group) as ``(Shard(0), Shard(0))`` over
    the 2-D mesh (EP blocks, then replica chunks within each)."""
    local = local.detach()
    placements = [Shard(0)] * mesh.ndim
    if isinstance(local, DTensor):
        local = local.to_local()
    shape = torch.Size((local.shape[0] * mesh.size(), *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def global_params(model: nn.Module) -> dict[str, DTensor]:
    """{fqn: the expert parameter as a global DTensor} (shapes and load templates of :mod:`checkpoint_fit`)."""
    return {fqn: _global(p, mesh) for fqn, (p, mesh) in sharded_experts(model).items()}


def globalize(model: nn.Module, state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"model": model state dict, "optim": flat optimizer state dict}`` (either part optional) with every
    expert tensor and moment replaced by its global DTensor (a view of the live tensor); other entries as given."""
    experts = sharded_experts(model)
    if not experts:
        return state
    out = {part: dict(entries) for part, entries in state.items()}
    for fqn, (_, mesh) in experts.items():
        if fqn in out.get("model", {}):
            out["model"][fqn] = _global(out["model"][fqn], mesh)
        for name in _MOMENTS:
            key = f"state.{fqn}.{name}"
            if key in out.get("optim", {}):
                out["optim"][key] = _global(out["optim"][key], mesh)
    return out


def localize(model: nn.Module, state: dict[str, dict[str, Any]]) -> None:
    """In place: every expert entry of ``state`` (as :func:`globalize` keys them) that is a DTensor becomes its
    local shard (this rank's experts), as the live model and optimizer hold them: a plain tensor, or under FSDP
    a DTensor on the parameter's own replica mesh."""
    for fqn, (param, _) in sharded_experts(model).items():
        keys = [("model", fqn)] + [("optim", f"state.{fqn}.{name}") for name in _MOMENTS]
        for part, key in keys:
            value = state.get(part, {}).get(key)
            if not isinstance(value, DTensor):
                continue
            local = value.to_local()
            if isinstance(param, DTensor):
                mesh, placements = param.device_mesh, param.placements
                local = DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
                )
            state[part][key] = local
