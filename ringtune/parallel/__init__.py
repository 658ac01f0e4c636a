"""Distributed runtime: the DP×CP×TP mesh (bounded timeouts), launchers, autograd-aware and control collectives."""

from ringtune.parallel.collectives import (
    RingExchange,
    all_gather,
    all_to_all,
    reduce_scatter,
    ring_shift,
)
from ringtune.parallel.control import (
    RankFailedError,
    agree,
    agreed_call,
    broadcast_object,
    gather_object_to,
    run_on_source,
)
from ringtune.parallel.launch import init_from_env, spawn
from ringtune.parallel.mesh import ParallelMesh, build_mesh, rebuild_mesh
from ringtune.parallel.meter import measure_comm

__all__ = [
    "ParallelMesh",
    "RankFailedError",
    "RingExchange",
    "agree",
    "agreed_call",
    "all_gather",
    "all_to_all",
    "broadcast_object",
    "build_mesh",
    "gather_object_to",
    "init_from_env",
    "measure_comm",
    "rebuild_mesh",
    "reduce_scatter",
    "ring_shift",
    "run_on_source",
    "spawn",
]
