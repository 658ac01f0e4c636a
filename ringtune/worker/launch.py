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
from collections.abc import Sequence
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
from ringtune.parallel.mesh import DEFAULT_TIMEOUT_S, ParallelMesh, build_mesh
from ringtune.worker.backend import DistributedBackend
from ringtune.worker.describe import describe
from ringtune.worker.executor import DTYPES, ModelSpec
from ringtune.worker.loop import worker_loop
from ringtune.worker.served_models import ServedModels
from ringtune.worker.supervisor import SupervisedBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerLayout:
    """The mesh of the worker ranks: ``dp`` × ``cp`` processes (expert parallelism ``ep`` carved out of them,
    :func:`~ringtune.parallel.mesh.build_mesh`), data-group timeout ``timeout_s`` seconds,
    liveness timeout ``liveness_timeout_s`` (:mod:`ringtune.parallel.liveness`: used only for a rank on another
    host, whose process this one cannot see); ``device_type`` (``cpu`` / ``cuda``) and the data groups'
    ``data_backend`` (``gloo`` / ``nccl``) as :func:`~ringtune.worker.device_defaults.resolve_device_settings`
    chose them (gloo with CUDA: ranks sharing a GPU, collectives staged through host memory)."""

    dp: int = 1
    cp: int = 1
    ep: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    liveness_timeout_s: float = liveness.DEFAULT_TIMEOUT_S
    device_type: str = "cpu"
    data_backend: str = "gloo"

    @property
    def world_size(self) -> int:
        """Ranks of the job: DP × CP."""
        return self.dp * self.cp


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _use_device(layout: WorkerLayout, rank: int) -> None:
    """Rank ``rank``'s GPU (ranks round-robin over the host's GPUs; with gloo data groups several share one)."""
    if layout.device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _mesh(layout: WorkerLayout) -> ParallelMesh:
    return build_mesh(
        dp=layout.dp,
        cp=layout.cp,
        ep=layout.ep,
        timeout_s=layout.timeout_s,
        device_type=layout.device_type,
        data_backend=layout.data_backend,
    )


def _worker_entry(rank: int, layout: WorkerLayout, specs: Sequence[ModelSpec], init_method: str) -> None:
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
        backend=layout.data_backend,
        timeout_s=layout.timeout_s,
    )
    _use_device(layout, rank)
    mesh = _mesh(layout)
    code = worker_loop(ServedModels(specs, mesh))
    if code == 0:
        dist.destroy_process_group()
    sys.exit(code)


@dataclass(frozen=True)
class DescribedModels:
    """Rank 0's served models after loading each once: ``specs`` (each with the tokenizer directory its
    description found), ``spares`` (the loaded copy of each by name; its first run takes it) and ``infos`` (what
    the gateway reports), all in ``--model`` order."""

    specs: tuple[ModelSpec, ...]
    spares: dict[str, CausalLM]
    infos: tuple[BackendInfo, ...]


def load_and_describe(
    specs: Sequence[ModelSpec],
    layout: WorkerLayout,
    tokenizer_dir: str | None,
    tokenizer_cache: str | Path | None,
) -> DescribedModels:
    """Rank 0: every served model loaded (a bad source fails before any process starts) and described;
    ``tokenizer_dir`` (``--tokenizer``) is the first model's, the others find their own."""
    spares, infos, described = {}, [], []
    for index, spec in enumerate(specs):
        model = load_model(spec.source, dtype=DTYPES[spec.dtype], device=spec.device(None))
        info = describe(
            spec,
            model,
            dp=layout.dp,
            cp=layout.cp,
            model_name=spec.name,
            tokenizer_dir=tokenizer_dir if index == 0 else None,
            tokenizer_cache=tokenizer_cache,
        )
        spares[spec.served_name] = model
        infos.append(info)
        described.append(replace(spec, tokenizer_dir=info.tokenizer_dir))
    return DescribedModels(tuple(described), spares, tuple(infos))


def start_supervised_workers(
    specs: Sequence[ModelSpec],
    layout: WorkerLayout,
    *,
    max_restarts: int,
    tokenizer_dir: str | None = None,
    tokenizer_cache: str | Path | None = None,
) -> SupervisedBackend:
    """Make this process rank 0 of ``layout`` on 127.0.0.1, spawn the other ranks (:func:`spawn_world`), under a
    :class:`SupervisedBackend`: dead worker ranks are restarted (up to ``max_restarts`` times) and the live runs
    of every served model restored (see :mod:`ringtune.worker.supervisor`).

    Every model of ``specs`` is loaded here first (a bad source fails before any process starts).
    """
    served = load_and_describe(specs, layout, tokenizer_dir, tokenizer_cache)
    spares = [served.spares]  # the first world's first runs take the described copies; a restarted world loads

    def start() -> DistributedBackend:
        return spawn_world(served.specs, layout, served.infos, spares=spares.pop() if spares else None)

    return SupervisedBackend(start, max_restarts=max_restarts)


def spawn_world(
    specs: Sequence[ModelSpec],
    layout: WorkerLayout,
    infos: Sequence[BackendInfo],
    *,
    spares: dict[str, CausalLM] | None = None,
) -> DistributedBackend:
    """A fresh world on 127.0.0.1 (a new port, so a new store): spawn ranks ``1..world-1``, make this process
    rank 0, build the mesh; rank 0's backend serving every model of ``specs`` (described by ``infos``) with no
    live run. Called at start-up and by the supervisor (:mod:`ringtune.worker.supervisor`) after the previous
    world was torn down (no default process group).

    ``spares``: models rank 0 already holds, by name (a model's first run takes its copy instead of loading one).
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(target=_worker_entry, args=(rank, layout, tuple(specs), init_method), name=f"ringtune-rank{rank}")
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
        backend=layout.data_backend,
        timeout_s=layout.timeout_s,
    )
    _use_device(layout, 0)
    mesh = _mesh(layout)
    return DistributedBackend(ServedModels(specs, mesh, spares=spares), infos, workers=workers)


def torchrun_restarts() -> int:
    """How many times torchrun's elastic agent has restarted this server's ranks (0: first start, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def join_torchrun_world(
    specs: Sequence[ModelSpec],
    layout: WorkerLayout,
    *,
    tokenizer_dir: str | None = None,
    tokenizer_cache: str | Path | None = None,
) -> DistributedBackend | None:
    """Under torchrun: rank 0 gets the backend (every model of ``specs``); the other ranks serve commands here
    until shutdown (None)."""
    liveness.configure(layout.liveness_timeout_s)
    rank = init_from_env(backend=layout.data_backend, timeout_s=layout.timeout_s)
    if dist.get_world_size() != layout.world_size:
        raise SystemExit(f"torchrun started {dist.get_world_size()} processes; --dp·--cp = {layout.world_size}")
    _use_device(layout, int(os.environ.get("LOCAL_RANK", "0")))
    mesh = _mesh(layout)
    served = load_and_describe(specs, layout, tokenizer_dir, tokenizer_cache) if rank == 0 else None
    tokenizers = broadcast_object([s.tokenizer_dir for s in served.specs] if served else None, mesh.control_group)
    specs = [replace(s, tokenizer_dir=t) for s, t in zip(specs, tokenizers, strict=True)]
    if served is None:
        code = worker_loop(ServedModels(specs, mesh))
        dist.destroy_process_group()
        raise SystemExit(code)
    return DistributedBackend(ServedModels(specs, mesh, spares=served.spares), served.infos)
