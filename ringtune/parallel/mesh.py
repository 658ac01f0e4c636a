"""The DP×CP×TP device mesh (TP reserved, size 1 for now) on torch.distributed.

Rank order is TP fastest, then CP, then DP: ``rank = (dp_rank·cp + cp_rank)·tp + tp_rank``, so a CP
group holds neighbouring ranks. Built on ``torch.distributed.device_mesh`` so that later FSDP2/TP
code can take the same mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ringtune.errors import ParallelConfigError


def default_backend(device_type: str) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True, kw_only=True)
class ParallelMesh:
    """A DP×CP×TP mesh and the process groups the ops talk over.

    Attributes:
        device_mesh: the torch DeviceMesh with dims ("dp", "cp", "tp").
        dp_size, cp_size, tp_size / dp_rank, cp_rank, tp_rank: sizes and this process's coordinates.
        cp_group: the ranks that share one packed row (ring / all-gather / all-to-all attention).
        dp_group: the ranks that hold different rows at the same CP and TP coordinate.
        dp_cp_group: every rank that holds a replica of the parameters (gradients SUM over it).
        replica: index of this independent mesh when several share the world (``build_mesh(replicas=)``).
    """

    device_mesh: DeviceMesh
    dp_size: int
    cp_size: int
    tp_size: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    replica: int = 0

    @property
    def device(self) -> torch.device:
        if self.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_mesh.device_type)


def build_mesh(*, dp: int, cp: int, tp: int = 1, replicas: int = 1, device_type: str | None = None) -> ParallelMesh:
    """Build the mesh over the whole (already initialised) default process group.

    ``replicas > 1`` lays that many independent DP×CP×TP meshes side by side (rank order: replica slowest);
    each holds its own copy of the model and talks only inside itself (tests compare layouts this way).
    Collective over the world: every rank must call it with the same sizes.
    Raises ParallelConfigError when ``replicas*dp*cp*tp`` is not the world size or tp != 1.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; launch with torchrun or ringtune.parallel.spawn")
    world = dist.get_world_size()
    for name, value in (("dp", dp), ("cp", cp), ("tp", tp), ("replicas", replicas)):
        if value < 1:
            raise ParallelConfigError(f"{name} must be >= 1, got {value}")
    if replicas * dp * cp * tp != world:
        raise ParallelConfigError(
            f"replicas*dp*cp*tp = {replicas}*{dp}*{cp}*{tp} = {replicas * dp * cp * tp} "
            f"must equal the world size {world}"
        )
    if tp != 1:
        raise ParallelConfigError(f"tp={tp}: tensor parallelism is reserved and must be 1 for now")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if replicas == 1:
        mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        replica = 0
    else:
        full = init_device_mesh(device_type, (replicas, dp, cp, tp), mesh_dim_names=("replica", "dp", "cp", "tp"))
        replica = full.get_coordinate()[0]
        mesh = full["dp", "cp", "tp"]
    coords = mesh.get_coordinate()
    assert coords is not None
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    return ParallelMesh(
        device_mesh=mesh,
        dp_size=dp,
        cp_size=cp,
        tp_size=tp,
        dp_rank=coords[0],
        cp_rank=coords[1],
        tp_rank=coords[2],
        cp_group=mesh.get_group("cp"),
        dp_group=mesh.get_group("dp"),
        dp_cp_group=dp_cp.get_group(),
        replica=replica,
    )
