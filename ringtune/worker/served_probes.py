"""Served probes: checks a server runs on its own ranks, with its own modes, dtype and device.

``POST /api/v1/ringtune/probe`` reaches :func:`run_served_probe` on every rank through the ``probe`` command
(:data:`ringtune.probes.ring_accumulation.SERVED_PROBES`: the ring-accumulation probe of the parity client).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ringtune.errors import UserInputError
from ringtune.parallel.control import gather_object_to
from ringtune.parallel.mesh import ParallelMesh
from ringtune.probes.ring_accumulation import (
    MISMATCH_LIMIT,
    SERVED_PROBES,
    mismatch_fraction,
    ring_accumulation_counts,
)


def run_served_probe(
    name: str, mesh: ParallelMesh | None, modes: Mapping[str, Any], dtype: torch.dtype
) -> dict[str, Any] | None:
    """Served probe ``name`` on this rank with the server's ``modes`` (``attention``, ``debug_fault``) in compute
    dtype ``dtype`` on the mesh's device; the JSON-able summary on rank 0 of the control group (None elsewhere).
    Collective over the mesh (each DP replica's CP group runs it, the counts are gathered over the control group).
    UserInputError (on every rank alike) for an unknown name."""
    if name not in SERVED_PROBES:
        raise UserInputError(f"probe={name!r} is not a served probe; choose one of {list(SERVED_PROBES)}")
    cp_size = mesh.cp_size if mesh else 1
    summary: dict[str, Any] = {"probe": name, "cp": cp_size, "dtype": str(dtype).removeprefix("torch.")}
    summary |= {"attention": modes["attention"], "limit": MISMATCH_LIMIT}
    if modes["attention"] != "ring":
        return summary | {"applies": False, "why": f"attention mode {modes['attention']!r} has no ring hops"}
    counts = ring_accumulation_counts(
        mesh.cp_group if mesh and cp_size > 1 else None,
        cp_size=cp_size,
        cp_rank=mesh.cp_rank if mesh else 0,
        dtype=dtype,
        device=mesh.device if mesh else torch.device("cpu"),
        fault=modes["debug_fault"],
    )
    parts = gather_object_to(counts, mesh.control_group if mesh else None, dst=0)
    if parts is None:
        return None
    fractions = mismatch_fraction(parts)
    if fractions is None:
        return summary | {"applies": False, "why": f"{summary['dtype']} is its own accumulator dtype"}
    return summary | {"applies": True, "mismatch": fractions, "elements": sum(c["dk"][1] for c in parts if c)}
