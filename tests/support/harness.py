"""A pool of gloo ranks that lives for one test module and runs many cases.

Spawning a process group costs seconds, so a test module starts one :class:`RankPool` (a
module-scoped fixture) and sends it cases: ``pool.run(case_fn, *args)`` runs ``case_fn(ctx, *args)``
on every rank and returns the per-rank results in rank order. ``case_fn`` must be a module-level
function (it is looked up by module and name in the workers). ``ctx`` is a :class:`RankContext` that
caches meshes, so a case asks ``ctx.mesh(dp=2, cp=2)`` without re-creating groups.

A case that raises on any rank, or does not finish within ``timeout`` seconds (a hang in a
collective), fails the call with every rank's report; the pool is then restarted for the next case. A
failure of the transport alone (a rank process crashed, its peers lost their connections) is retried once,
with a warning (see :meth:`RankPool.run`).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import queue as queue_mod
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from ringtune.parallel.launch import free_port, init_process_group
from ringtune.parallel.mesh import DEFAULT_TIMEOUT_S, ParallelMesh, build_mesh

FAILURE_GRACE_S = 3.0
"""After one rank fails, how long the pool still listens for the others (their errors, or exit codes)."""

TRANSPORT_SYMPTOMS = ("Connection reset by peer", "Connection closed by peer")
"""What gloo raises on the ranks whose peer process went away (the echo of a crash, not a cause)."""


@dataclass
class RankContext:
    """What a case function gets on each rank: its rank, the world size and cached meshes."""

    rank: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    _meshes: dict[tuple[int, ...], ParallelMesh] = field(default_factory=dict)

    def mesh(self, *, dp: int, cp: int, tp: int = 1, ep: int = 1) -> ParallelMesh:
        """The DP×CP×TP mesh (EP ``ep``) over the pool; smaller than the pool, replicated side by side (cached)."""
        key = (dp, cp, tp) if ep == 1 else (dp, cp, tp, ep)
        if key not in self._meshes:
            replicas = self.world_size // (dp * cp * tp)
            self._meshes[key] = build_mesh(
                dp=dp, cp=cp, tp=tp, ep=ep, replicas=replicas, device_type="cpu", timeout_s=self.timeout_s
            )
        return self._meshes[key]


def _resolve(module: str, path: str | None, qualname: str) -> Callable:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(module, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank: int, world_size: int, init_method: str, timeout_s: float, tasks, results) -> None:
    torch.set_num_threads(1)
    faulthandler.enable()  # a segfault or abort in a collective prints every thread's stack to stderr
    init_process_group(rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s)
    ctx = RankContext(rank=rank, world_size=world_size, timeout_s=timeout_s)
    while True:
        task = tasks.get()
        if task is None:
            break
        module, path, qualname, args, kwargs = task
        try:
            fn = _resolve(module, path, qualname)
            results.put((rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))


class RankPool:
    """``world_size`` gloo ranks on this host waiting for cases; see the module docstring."""

    def __init__(self, world_size: int, *, timeout: float = 600.0, collective_timeout_s: float = DEFAULT_TIMEOUT_S):
        """``timeout``: seconds a case may take; ``collective_timeout_s``: the meshes' data-group timeout."""
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout_s = collective_timeout_s
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_method, self.collective_timeout_s, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, allow_dead: bool = False, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; per-rank return values in rank order.

        ``allow_dead``: a rank process that dies (a SIGKILL test) gives None instead of failing the call;
        the others are still waited for, and the pool restarts afterwards.

        A failure that is only the transport's (a rank process crashed without a Python error, and every
        error the others raised is a lost connection: :data:`TRANSPORT_SYMPTOMS`) is retried once on the
        restarted pool, with a RuntimeWarning that carries the first attempt's report; a case that fails
        the same way twice fails. Python errors, assertion failures and hangs are never retried.
        """
        values, failures, transport_only = self._run_once(fn, args, kwargs, allow_dead)
        if failures and transport_only:
            warnings.warn(
                f"{fn.__qualname__}: the rank pool lost a rank or a connection; retrying once on a fresh pool. "
                "First attempt:\n" + "\n".join(failures),
                RuntimeWarning,
                stacklevel=2,
            )
            values, failures, _ = self._run_once(fn, args, kwargs, allow_dead)
        if failures:
            raise RuntimeError(f"{fn.__qualname__} failed on the rank pool:\n" + "\n".join(failures))
        return values

    def _run_once(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], allow_dead: bool
    ) -> tuple[list[Any], list[str], bool]:
        """One attempt: (per-rank values, failure reports, whether the failure is only the transport's)."""
        module = fn.__module__
        path = getattr(sys.modules.get(module), "__file__", None)
        for q in self._tasks:
            q.put((module, path, fn.__qualname__, args, kwargs))
        got: dict[int, Any] = {}
        dead: dict[int, int | None] = {}  # rank -> exit code
        failed: dict[int, str] = {}  # rank -> traceback
        deadline = time.monotonic() + self.timeout
        grace_until: float | None = None  # after a first failure: collect the other ranks' news briefly
        while len(got) + len(dead) + len(failed) < self.world_size:
            now = time.monotonic()
            if (grace_until is not None and now > grace_until) or now > deadline:
                break
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue_mod.Empty:
                for r, p in enumerate(self._procs):
                    if r not in got and r not in dead and r not in failed and not p.is_alive():
                        dead[r] = p.exitcode
                if grace_until is None and dead and not allow_dead:
                    grace_until = now + FAILURE_GRACE_S
                continue
            if ok:
                got[rank] = value
            else:
                # The other ranks may be stuck in a collective: hear them for a moment, then restart the pool.
                failed[rank] = value
                grace_until = grace_until or time.monotonic() + FAILURE_GRACE_S
        failures = [f"rank {r}:\n{tb}" for r, tb in sorted(failed.items())]
        if not allow_dead:
            failures += [f"rank {r} died (exit code {code})" for r, code in sorted(dead.items())]
        pending = [r for r in range(self.world_size) if r not in got and r not in dead and r not in failed]
        timed_out = bool(pending) and not failures
        if timed_out:
            failures.append(f"timed out after {self.timeout}s with ranks {sorted(got)} done (a hang?)")
        if failures:
            failures.append(f"ranks done: {sorted(got)}; no answer from: {pending}")
        if failures or dead:
            self._restart()
        symptoms_only = all(any(s in tb for s in TRANSPORT_SYMPTOMS) for tb in failed.values())
        transport_only = bool(failures) and not timed_out and symptoms_only and (bool(failed) or not allow_dead)
        return [got.get(r) for r in range(self.world_size)], failures, transport_only

    def _restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, *, graceful: bool = True) -> None:
        for p, q in zip(self._procs, self._tasks, strict=True):
            if graceful and p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=10 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
