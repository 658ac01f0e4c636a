"""Fresh data groups after a failure inside a collective, on every rank of the mesh."""

from __future__ import annotations

from collections.abc import Iterable

from ringtune.engine.trainer import SHARDED_GROUPS_LOST, Trainer
from ringtune.parallel.mesh import ParallelMesh, rebuild_mesh


def repair_groups(mesh: ParallelMesh | None, trainers: Iterable[Trainer]) -> None:
    """Rebuild ``mesh``'s data groups (collective over the whole mesh, after the ranks agreed a rank failed inside
    one; see the trainer's repair); a run of ``trainers`` whose parameters are FSDP-sharded cannot move to the new
    groups and is marked broken. Nothing without a mesh."""
    if mesh is None:
        return
    rebuild_mesh(mesh)
    for trainer in trainers:
        if trainer.fsdp_units:
            trainer.broken = SHARDED_GROUPS_LOST
