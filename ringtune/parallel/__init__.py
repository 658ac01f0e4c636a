"""Distributed runtime: the DP×CP×TP mesh, launchers and autograd-aware collectives."""

from ringtune.parallel.collectives import (
    RingExchange,
    all_gather,
    all_to_all,
    reduce_scatter,
    ring_shift,
)
from ringtune.parallel.launch import init_from_env, spawn
from ringtune.parallel.mesh import ParallelMesh, build_mesh
from ringtune.parallel.meter import measure_comm

__all__ = [
    "ParallelMesh",
    "RingExchange",
    "all_gather",
    "all_to_all",
    "build_mesh",
    "init_from_env",
    "measure_comm",
    "reduce_scatter",
    "ring_shift",
    "spawn",
]
