"""Starting the worker ranks of ``ringtune serve``: spawned on this machine, or under torchrun across machines.

- :func:`start_supervised_workers`: this process becomes rank 0 of a DP×CP world on 127.0.0.1; it spawns the
  other ``dp·cp - 1`` ranks as processes (gloo on CPU, NCCL on CUDA, :func:`spawn_world`), builds the mesh and
  returns rank 0's backend, a :class:`~ringtune.worker.supervisor.SupervisedBackend` that restarts dead worker
  ranks (the gateway serves HTTP from this process).
- :func:`join_torchrun_world`: every torchrun process calls it; rank 0 gets the backend (and serves HTTP),
  every other rank runs :func:`~ringtune.worker.loop.worker_loop` until shutdown and gets None.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringtune.gateway.backend import BackendInfo
from ringtune.models.checkpoints.load import load_model
from ringtune.models.decoder import CausalLM
from ringtune.parallel import liveness
from ringtune.parallel.control import broadcast_object
from ringtune.parallel.launch import free_port, init_from_env, init_process_group
from ringtune.parallel.mesh import DEFAULT_TIMEOUT_S, build_mesh
from ringtune.worker.backend import DistributedBackend
from ringtune.worker.describe import describe
from ringtune.worker.executor import DTYPES, ModelSpec, RankExecutor
from ringtune.worker.loop import worker_loop
from ringtune.worker.supervisor import SupervisedBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerLayout:
    """The mesh of the worker ranks: ``dp`` × ``cp`` processes (expert parallelism ``ep`` carved out of them,
    :func:`~ringtune.parallel.mesh.build_mesh`), data-group timeout ``timeout_s`` seconds,
    liveness timeout ``liveness_timeout_s`` (:mod:`ringtune.parallel.liveness`: used only for a rank on another
    host, whose process this one cannot see)."""

    dp: int = 1
    cp: int = 1
    ep: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    liveness_timeout_s: float = liveness.DEFAULT_TIMEOUT_S

    @property
    def world_size(self) -> int:
        """Ranks of the job: DP × CP."""
        return self.dp * self.cp


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _backend_kind() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker_entry(rank: int, layout: WorkerLayout, spec: ModelSpec, init_method: str) -> None:
    # Rank 0 owns the shutdown (a Ctrl-C or a SIGTERM sent to the whole process group must not kill a worker
    # under a request in flight): a worker exits when rank 0 sends ``shutdown`` or when rank 0 is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(_threads(layout.world_size))
    liveness.configure(layout.liveness_timeout_s)
    init_process_group(
        rank=rank,
        world_size=layout.world_size,
        init_method=init_method,
        backend=_backend_kind(),
        timeout_s=layout.timeout_s,
    )
    if _backend_kind() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = build_mesh(dp=layout.dp, cp=layout.cp, ep=layout.ep, timeout_s=layout.timeout_s)
    code = worker_loop(RankExecutor(spec, mesh))
    if code == 0:
        dist.destroy_process_group()
    sys.exit(code)


def _load_and_describe(
    spec: ModelSpec,
    layout: WorkerLayout,
    model_name: str | None,
    tokenizer_dir: str | None,
    tokenizer_cache: str | Path | None,
) -> tuple[CausalLM, BackendInfo]:
    """Rank 0: the model (its first run takes this copy) and the description the gateway reports."""
    model = load_model(spec.source, dtype=DTYPES[spec.dtype])
    names = {"model_name": model_name, "tokenizer_dir": tokenizer_dir, "tokenizer_cache": tokenizer_cache}
    return model, describe(spec, model, dp=layout.dp, cp=layout.cp, **names)


def start_supervised_workers(
    spec: ModelSpec,
    layout: WorkerLayout,
    *,
    max_restarts: int,
    model_name: str | None = None,
    tokenizer_dir: str | None = None,
    tokenizer_cache: str | Path | None = None,
) -> SupervisedBackend:
    """Make this process rank 0 of ``layout`` on 127.0.0.1, spawn the other ranks (:func:`spawn_world`), under a
    :class:`SupervisedBackend`: dead worker ranks are restarted (up to ``max_restarts`` times) and the live runs
    restored (see :mod:`ringtune.worker.supervisor`).

    The model is loaded here first (a bad source fails before any process starts).
    """
    model, info = _load_and_describe(spec, layout, model_name, tokenizer_dir, tokenizer_cache)
    spec = replace(spec, tokenizer_dir=info.tokenizer_dir)
    spare = [model]  # the first world's first run takes the described copy; a restarted world loads its own

    def start() -> DistributedBackend:
        return spawn_world(spec, layout, info, spare=spare.pop() if spare else None)

    return SupervisedBackend(start, max_restarts=max_restarts)


def spawn_world(
    spec: ModelSpec, layout: WorkerLayout, info: BackendInfo, *, spare: CausalLM | None = None
) -> DistributedBackend:
    """A fresh world on 127.0.0.1 (a new port, so a new store): spawn ranks ``1..world-1``, make this process
    rank 0, build the mesh; rank 0's backend with no live run. Called at start-up and by the supervisor
    (:mod:`ringtune.worker.supervisor`) after the previous world was torn down (no default process group).

    ``spare``: a model rank 0 already holds (the first run takes it instead of loading another copy).
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(target=_worker_entry, args=(rank, layout, spec, init_method), name=f"ringtune-rank{rank}")
        for rank in range(1, layout.world_size)
    ]
    for p in workers:
        p.start()
    torch.set_num_threads(_threads(layout.world_size))
    liveness.configure(layout.liveness_timeout_s)
    init_process_group(
        rank=0,
        world_size=layout.world_size,
        init_method=init_method,
        backend=_backend_kind(),
        timeout_s=layout.timeout_s,
    )
    mesh = build_mesh(dp=layout.dp, cp=layout.cp, ep=layout.ep, timeout_s=layout.timeout_s)
    return DistributedBackend(RankExecutor(spec, mesh, spare=spare), info, workers=workers)


def torchrun_restarts() -> int:
    """How many times torchrun's elastic agent has restarted this server's ranks (0: first start, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def join_torchrun_world(
    spec: ModelSpec,
    layout: WorkerLayout,
    *,
    model_name: str | None = None,
    tokenizer_dir: str | None = None,
    tokenizer_cache: str | Path | None = None,
) -> DistributedBackend | None:
    """Under torchrun: rank 0 gets the backend; the other ranks serve commands here until shutdown (None)."""
    liveness.configure(layout.liveness_timeout_s)
    rank = init_from_env(timeout_s=layout.timeout_s)
    if dist.get_world_size() != layout.world_size:
        raise SystemExit(f"torchrun started {dist.get_world_size()} processes; --dp·--cp = {layout.world_size}")
    mesh = build_mesh(dp=layout.dp, cp=layout.cp, ep=layout.ep, timeout_s=layout.timeout_s)
    model = info = None
    if rank == 0:
        model, info = _load_and_describe(spec, layout, model_name, tokenizer_dir, tokenizer_cache)
    spec = replace(spec, tokenizer_dir=broadcast_object(info.tokenizer_dir if info else None, mesh.control_group))
    if rank != 0:
        code = worker_loop(RankExecutor(spec, mesh))
        dist.destroy_process_group()
        raise SystemExit(code)
    return DistributedBackend(RankExecutor(spec, mesh, spare=model), info)
