"""DistributedBackend: the gateway's :class:`~ringtune.gateway.backend.Backend` on rank 0 of a DP×CP mesh (or of
no mesh: :class:`~ringtune.gateway.local.LocalBackend`).

Each verb becomes a :class:`~ringtune.worker.commands.Command` that rank 0 publishes through the job's store
(:func:`ringtune.parallel.store_exchange.publish_object`) and then executes itself, together with every worker rank
(:func:`ringtune.worker.loop.worker_loop`). One transport: torch.distributed (its store and its process
groups); no second RPC system. The gateway calls the verbs from one thread, so commands are totally ordered.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.errors import RankFailedError, UserInputError
from ringtune.gateway.backend import BackendHealth, BackendInfo
from ringtune.parallel import liveness
from ringtune.parallel.store_exchange import publish_object
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.sampler import PromptSamples
from ringtune.worker.commands import Command
from ringtune.worker.executor import RankExecutor
from ringtune.worker.loop import CHANNEL


class DistributedBackend:
    """Rank 0's side: publish each verb as a command, execute it here too, return rank 0's result.

    Args:
        executor: rank 0's :class:`RankExecutor` over the mesh.
        info: the served model's description (built on rank 0, as the local backend does).
        workers: the worker processes started by this process (joined at :meth:`close`), or [] under torchrun.
    """

    def __init__(self, executor: RankExecutor, info: BackendInfo, *, workers: Sequence[Any] = ()) -> None:
        self.executor, self._info, self.workers = executor, info, list(workers)
        self._dead: str | None = None
        self._lock = threading.Lock()

    def info(self) -> BackendInfo:
        return self._info

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

    def create_run(self, run_id: str, base_model: str, lora: Mapping[str, Any] | None = None) -> None:
        if base_model not in (self._info.model_name, *self._info.aliases):
            raise UserInputError(f"base_model={base_model!r} is not served here; use {self._info.model_name!r}")
        self._run(Command("create_run", run_id, {"lora": None if lora is None else dict(lora)}))

    def free_run(self, run_id: str) -> None:
        self._run(Command("free_run", run_id))

    def forward_backward(
        self,
        run_id: str,
        data: Sequence[TrainDatum],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        args = {"data": list(data), "loss_fn": loss_fn, "loss_config": loss_config, "forward_only": forward_only}
        outputs, metrics = self._run(Command("forward_backward", run_id, args))
        return outputs, metrics

    def forward_backward_many(
        self,
        run_ids: Sequence[str],
        data: Sequence[Sequence[TrainDatum]],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> list[tuple[list[dict[str, torch.Tensor]], dict[str, float]] | UserInputError]:
        args = {
            "runs": list(run_ids),
            "data": [list(d) for d in data],
            "loss_fn": loss_fn,
            "loss_config": loss_config,
            "forward_only": forward_only,
        }
        results = self._run(Command("forward_backward_many", None, args))
        return [UserInputError(r) if isinstance(r, str) else r for r in results]

    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        return self._run(Command("optim_step", run_id, {"adam": adam}))

    def save_state(self, run_id: str, path: str) -> None:
        self._run(Command("save_state", run_id, {"path": path}))

    def load_state(self, run_id: str, path: str, optimizer: bool) -> None:
        self._run(Command("load_state", run_id, {"path": path, "optimizer": optimizer}))

    def export_for_sampler(self, run_id: str, path: str) -> None:
        self._run(Command("export_hf", run_id, {"path": path}))

    def create_sampler(self, sampler_id: str, source: SamplerSource) -> None:
        self._run(Command("create_sampler", None, {"sampler_id": sampler_id, "source": source}))

    def free_sampler(self, sampler_id: str) -> None:
        self._run(Command("free_sampler", None, {"sampler_id": sampler_id}))

    def sample(
        self,
        sampler_id: str,
        requests: Sequence[SampleRequest],
        *,
        job_id: str | None = None,
        slice_s: float | None = None,
    ) -> list[PromptSamples] | None:
        fixed = [r.with_fixed_seed() for r in requests]  # every rank draws a long prompt's alt tokens alike
        args = {"sampler_id": sampler_id, "requests": fixed, "job_id": job_id, "slice_s": slice_s}
        return self._run(Command("sample", None, args))

    def sample_more(self, job_id: str, slice_s: float | None = None) -> list[PromptSamples] | None:
        return self._run(Command("sample_more", None, {"job_id": job_id, "slice_s": slice_s}))

    def probe(self, name: str) -> dict[str, Any]:
        return self._run(Command("probe", None, {"name": name}))

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
        self.executor.trainers.clear()
        self.executor.samplers.snapshots.clear()
        gc.collect()
