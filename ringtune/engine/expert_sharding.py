"""FSDP2 of expert-parallel experts: each EP rank's experts sharded again over its expert replica group.

Under EP (``mesh.ep_size`` = N > 1) a rank holds experts ``[e·E/N, (e+1)·E/N)`` of every MoE layer (``e`` its
``ep_rank``) and the (DP·CP)/N ranks of its **expert replica group** hold the same ones. With ``--shard-params
dp_cp`` those E/N experts are a unit of their own, ``fully_shard`` over a 1-D DeviceMesh of the expert replica
group (torchtitan's ``dp_shard_mod_ep``), before the decoder layers are sharded over DP×CP (a layer's unit then
manages its other parameters only). So every rank keeps 1/(DP·CP) of the expert weights, gradients and moments:
rank (e, g) (replica index g) holds the dim-0 chunk g of EP rank e's experts, and the DP×CP ranks partition
every expert tensor exactly once. FSDP reduce-scatters the expert gradients over the replica group (SUM, like
the replicated engine's expert all-reduce), the rest over DP×CP.

A checkpoint sees an expert tensor as one global [E, ...] DTensor on the 2-D DeviceMesh ``("ep",
"expert_replica")`` with ``(Shard(0), Shard(0))``: split into N blocks by ``ep_rank``, each block into chunks by
replica index (:func:`global_mesh`, used by :mod:`ringtune.engine.expert_checkpoint`), so the checkpoint has the
keys and shapes of an EP = 1 model's and any layout loads it. Contract: every function here is collective over
the mesh's DP×CP ranks only through ``DeviceMesh.from_group`` (no new process group).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ringtune.errors import ParallelConfigError
from ringtune.models.layers.moe import moe_blocks
from ringtune.parallel.mesh import ParallelMesh


def replica_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The 1-D DeviceMesh ``("expert_replica",)`` on ``mesh.expert_replica_group`` (ranks with this ep_rank)."""
    flat = mesh.ranks[:, :, mesh.tp_rank].flatten()
    ranks = flat[mesh.ep_rank :: mesh.ep_size].contiguous()
    return DeviceMesh.from_group(
        mesh.expert_replica_group, mesh.device_type, mesh=ranks, mesh_dim_names=("expert_replica",)
    )


def global_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The 2-D DeviceMesh ``("ep", "expert_replica")`` of the DP×CP ranks: ``[ep_rank, replica index]`` (a
    rank's DP×CP index is ``replica index · ep + ep_rank``, :mod:`ringtune.parallel.mesh`)."""
    flat = mesh.ranks[:, :, mesh.tp_rank].flatten()
    ranks = flat.reshape(-1, mesh.ep_size).T.contiguous()
    groups = [mesh.ep_group, mesh.expert_replica_group]
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=ranks, mesh_dim_names=("ep", "expert_replica"))


def replicas(mesh: ParallelMesh) -> int:
    """The size of the expert replica group, (DP·CP)/EP."""
    return mesh.dp_size * mesh.cp_size // mesh.ep_size


def check(model: nn.Module, mesh: ParallelMesh, sharding: str) -> None:
    """ParallelConfigError when ``sharding`` cannot shard ``model``'s expert-parallel experts: only ``dp_cp``
    (``dp`` keeps replicas over CP, which the experts do not have), and E/EP divisible by the replica count
    (equal chunks: every rank's share the same size)."""
    if mesh.ep_size == 1:
        return
    if sharding != "dp_cp":
        raise ParallelConfigError(
            f"shard_params={sharding!r} with ep={mesh.ep_size}: under expert parallelism use shard_params='dp_cp' "
            "(the experts are sharded over their expert replica group, everything else over DP x CP)"
        )
    count = replicas(mesh)
    for block in moe_blocks(model):
        if block.experts.num_local % count:
            raise ParallelConfigError(
                f"shard_params='dp_cp' with ep={mesh.ep_size}: each rank's {block.experts.num_local} experts "
                f"must split evenly over the {count} ranks of its expert replica group"
            )


def shard_experts(model: nn.Module, mesh: ParallelMesh, policy: MixedPrecisionPolicy) -> list[FSDPModule]:
    """In place: ``fully_shard`` every MoE layer's ``experts`` over the expert replica group (call before the
    layers are sharded); each block remembers :func:`global_mesh` as ``expert_global_mesh`` for checkpoints.
    Returns the units ([] without EP)."""
    if mesh.ep_size == 1:
        return []
    shard_mesh, whole = replica_mesh(mesh), global_mesh(mesh)
    units = []
    for block in moe_blocks(model):
        units.append(fully_shard(block.experts, mesh=shard_mesh, reshard_after_forward=True, mp_policy=policy))
        block.expert_global_mesh = whole
    return units
