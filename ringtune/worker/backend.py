"""DistributedBackend: the gateway's :class:`~ringtune.gateway.backend.Backend` on rank 0 of a DP×CP mesh (or of
no mesh: :class:`~ringtune.worker.local.LocalBackend`), serving one or several base models on that mesh
(:mod:`ringtune.worker.served_models`).

Each verb becomes a :class:`~ringtune.worker.commands.Command` that rank 0 publishes through the job's store
(:func:`ringtune.parallel.store_exchange.publish_object`) and then executes itself, together with every worker rank
(:func:`ringtune.worker.loop.worker_loop`). One transport: torch.distributed (its store and its process
groups); no second RPC system. The gateway calls the verbs from one thread, so commands are totally ordered.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ringtune.errors import RankFailedError, UserInputError
from ringtune.gateway.backend import VERBS, BackendHealth, BackendInfo, served_info
from ringtune.gateway.verbs import Verb, forward_verbs
from ringtune.parallel import liveness
from ringtune.parallel.store_exchange import publish_object
from ringtune.worker.commands import Command
from ringtune.worker.loop import CHANNEL
from ringtune.worker.served_models import ServedModels


@forward_verbs(VERBS)
class DistributedBackend:
    """Rank 0's side: publish each verb as a command, execute it here too, return rank 0's result.

    Args:
        executor: rank 0's :class:`ServedModels` over the mesh (one executor per served model).
        infos: the served models' descriptions, in ``executor``'s order (built on rank 0 at start-up).
        workers: the worker processes started by this process (joined at :meth:`close`), or [] under torchrun.
    """

    def __init__(self, executor: ServedModels, infos: Sequence[BackendInfo], *, workers: Sequence[Any] = ()) -> None:
        if [i.model_name for i in infos] != list(executor.executors):
            names = [i.model_name for i in infos]
            raise ValueError(f"infos {names} do not match the executors {list(executor.executors)}")
        self.executor, self._infos, self.workers = executor, tuple(infos), list(workers)
        self._dead: str | None = None
        self._lock = threading.Lock()

    def info(self) -> BackendInfo:
        """The first served model's description (built at start-up)."""
        return self._infos[0]

    def models(self) -> tuple[BackendInfo, ...]:
        """Every served model's description, the first one first (built at start-up)."""
        return self._infos

    def health(self) -> BackendHealth:
        """ok only if the mesh can serve: no rank found dead (by a command, or now by
        :func:`ringtune.parallel.liveness.dead_ranks`: the OS on this host, heartbeats elsewhere), no worker
        process this backend started has exited, no run's trainer is broken. Safe from any thread."""
        dead = self._dead or self.executor.broken
        gone = [p.pid for p in self.workers if not p.is_alive()]
        if gone and not dead:
            dead = f"worker process(es) {gone} exited"
        mesh = self.executor.mesh
        if mesh is not None and not dead and dist.is_initialized():
            lost = liveness.dead_ranks([int(r) for r in mesh.ranks.flatten().tolist() if r != dist.get_rank()])
            dead = "; ".join(lost.values()) or None
        extra: dict[str, float | str] = {"live_runs": float(len(self.executor.trainers))}
        if mesh is not None:
            extra.update(dp=float(mesh.dp_size), cp=float(mesh.cp_size), mesh_generation=float(mesh.generation))
        return BackendHealth(ok=dead is None, detail=dead or "", extra=extra)

    def _run(self, command: Command) -> Any:
        with self._lock:
            health = self.health()
            if not health.ok:
                raise RankFailedError(f"the worker ranks cannot serve: {health.detail}; restart the server")
            if self.executor.mesh is not None:  # a single process (LocalBackend) has no other rank to tell
                publish_object(command, CHANNEL)
            try:
                return self.executor.execute(command)
            except RankFailedError as exc:
                if exc.error_type == "RankDied" or self.executor.broken:
                    self._dead = str(exc)
                raise

    def call_verb(self, one: Verb, arguments: dict[str, Any]) -> Any:
        """Verb ``one`` as its command on every rank (rank 0's result); its run id travels as the command's
        ``run_id``, every other argument in ``args`` under its own name. Checks and adapts the arguments of
        ``create_run`` (a served base model, by name or alias: the workers get its name) and ``sample`` (fixed
        seeds), and turns ``forward_backward_many``'s per-run error messages back into UserInputErrors."""
        if one.command is None:
            raise TypeError(f"{one.name} is answered by the backend itself, not a command")
        if one.name == "create_run":  # the workers know each model by its name, not by its aliases
            arguments["base_model"] = served_info(self._infos, arguments["base_model"]).model_name
        if one.name == "sample":  # every rank draws a long prompt's alt tokens alike
            arguments["requests"] = [r.with_fixed_seed() for r in arguments["requests"]]
        run_id = arguments.pop("run_id", None)
        result = self._run(Command(one.command, run_id, arguments))
        if one.name == "forward_backward_many":
            return [UserInputError(r) if isinstance(r, str) else r for r in result]
        return result

    def close(self) -> None:
        """Tell the workers to exit and join the processes this backend started."""
        if self._dead is None and not self.executor.broken:
            try:
                self._run(Command("shutdown"))
            except Exception:
                pass
        for p in self.workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        self.executor.clear()
        gc.collect()
