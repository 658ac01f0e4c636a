"""Starting the process group: under torchrun (env://) or with an in-process spawner.

``init_from_env()`` is what a torchrun-launched entry point calls. ``spawn(fn, world_size, *args)``
starts ``world_size`` local processes (gloo on CPU), runs ``fn(rank, *args)`` in each and returns
their results in rank order; for tools, benchmarks and the test harness, never for multi-node.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringtune.parallel import liveness
from ringtune.parallel.mesh import DEFAULT_TIMEOUT_S, control_timeout_s


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_timeout(timeout_s: float) -> timedelta:
    """The default (world) group's timeout for data timeout ``timeout_s``: the control groups' timeout.

    The world group carries what every rank waits on together (checkpoint saves, mesh construction).
    """
    return timedelta(seconds=control_timeout_s(timeout_s))


def init_process_group(
    *, rank: int, world_size: int, init_method: str, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Initialise the default process group with a bounded timeout (see :func:`world_timeout`)."""
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=world_timeout(timeout_s)
    )
    liveness.join()  # every rank publishes who it is and beats from the moment it joins


def init_from_env(backend: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT); returns the rank."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=world_timeout(timeout_s))
    liveness.join()
    return dist.get_rank()


def _spawn_entry(rank: int, fn: Callable, world_size: int, init_method: str, threads: int, queue, args) -> None:
    torch.set_num_threads(threads)
    try:
        init_process_group(rank=rank, world_size=world_size, init_method=init_method)
        result = fn(rank, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` fresh gloo ranks on this host; results in rank order.

    ``fn`` must be importable (module level). Raises RuntimeError with the first failing rank's traceback.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_spawn_entry, args=(r, fn, world_size, init_method, threads, queue, args), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure = None
    for _ in procs:
        rank, ok, value = queue.get()
        if ok:
            results[rank] = value
        else:
            failure = failure or f"rank {rank} failed:\n{value}"
            break
    if failure:
        for p in procs:
            p.terminate()
    for p in procs:
        p.join()
    if failure:
        raise RuntimeError(failure)
    return [results[r] for r in range(world_size)]
