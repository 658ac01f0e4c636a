"""What every rank does with a command: one :class:`~ringtune.engine.trainer.Trainer` per training run.

Every rank of the mesh holds a replica (or FSDP shard) of each live run and executes each command with the
same arguments; the engine's collectives keep them in step. Every command ends with an agreement over the
mesh's control group (:func:`ringtune.parallel.control.agreed_call`): all ranks raise the same error or none
does, and the command channel relies on that to recycle its messages.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.load import load_model
from ringtune.models.decoder import CausalLM
from ringtune.parallel.control import agreed_call, gather_object_to
from ringtune.parallel.mesh import ParallelMesh
from ringtune.sample.pool import SamplerPool, tokenizer_decoder
from ringtune.sample.sampler import PromptSamples
from ringtune.worker.commands import Command


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How every rank builds a run's model and trainer (identical on every rank).

    Attributes:
        source: what :func:`load_model` reads (HF dir, ``.gguf`` file, or the embedded default name).
        dtype: parameter dtype name (``float32``, ``bfloat16``, ``float64``).
        max_tokens_per_rank: the engine's per-rank token budget.
        trainer_options: keyword arguments of :class:`Trainer` (``attention``, ``gated_delta``, ...).
        tokenizer_dir: the served tokenizer (stop strings are matched on decoded text), or None.
    """

    source: str
    dtype: str
    max_tokens_per_rank: int
    trainer_options: Mapping[str, Any] = field(default_factory=dict)
    tokenizer_dir: str | None = None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class RankExecutor:
    """This rank's live runs and how it executes each :class:`Command` (collective over the mesh)."""

    def __init__(
        self,
        spec: ModelSpec,
        mesh: ParallelMesh | None,
        *,
        spare: CausalLM | None = None,
    ) -> None:
        if spec.dtype not in DTYPES:
            raise UserInputError(f"dtype={spec.dtype!r} must be one of {list(DTYPES)}")
        self.spec, self.mesh = spec, mesh
        self.trainers: dict[str, Trainer] = {}
        self._spare = spare
        self.samplers = SamplerPool(
            lambda path: load_model(path or spec.source, dtype=DTYPES[spec.dtype]),
            decode=tokenizer_decoder(spec.tokenizer_dir),
        )
        self.handlers: dict[str, Callable[[Command], Any]] = {
            "create_run": self._create_run,
            "free_run": self._free_run,
            "forward_backward": self._forward_backward,
            "optim_step": lambda c: self._trainer(c).optim_step(c.args["adam"]),
            "save_state": lambda c: self._trainer(c).save_state(c.args["path"]),
            "load_state": lambda c: self._trainer(c).load_state(c.args["path"], optimizer=c.args["optimizer"]),
            "export_hf": lambda c: self._trainer(c).export_hf(c.args["path"]),
            "create_sampler": lambda c: self.samplers.create(c.args["sampler_id"], c.args["source"], self.trainers),
            "free_sampler": lambda c: self.samplers.free(c.args["sampler_id"]),
            "sample": self._sample,
            "ping": lambda c: None,
            "shutdown": lambda c: None,
        }

    @property
    def broken(self) -> str | None:
        """Why a run's trainer can no longer serve (a rank died), or None."""
        return next((t.broken for t in self.trainers.values() if t.broken), None)

    def execute(self, command: Command) -> Any:
        """Run ``command`` on this rank and agree with the others; its result (meaningful on the result rank).

        Raises the agreed error on every rank: UserInputError (nothing changed) or RankFailedError.
        """
        return agreed_call(lambda: self.handlers[command.op](command), self.mesh.control_group if self.mesh else None)

    def _trainer(self, command: Command) -> Trainer:
        trainer = self.trainers.get(command.run_id or "")
        if trainer is None:
            raise UserInputError(f"run {command.run_id!r} is not live on the workers (live: {sorted(self.trainers)})")
        return trainer

    def _create_run(self, command: Command) -> None:
        if command.run_id in self.trainers:
            raise UserInputError(f"run {command.run_id!r} exists already")
        spare, self._spare = self._spare, None  # rank 0 loaded one copy to describe the model: the first run takes it
        model = agreed_call(
            lambda: spare if spare is not None else load_model(self.spec.source, dtype=DTYPES[self.spec.dtype]),
            self.mesh.control_group if self.mesh else None,
        )
        self.trainers[command.run_id] = Trainer(
            model, self.mesh, max_tokens_per_rank=self.spec.max_tokens_per_rank, **dict(self.spec.trainer_options)
        )

    def _free_run(self, command: Command) -> None:
        if self.trainers.pop(command.run_id or "", None) is not None:
            gc.collect()

    def _sample(self, command: Command) -> list[PromptSamples] | None:
        """Requests spread round-robin over the ranks (each samples its share on its own snapshot replica);
        results gathered on the result rank in request order (None elsewhere)."""
        group = self.mesh.control_group if self.mesh else None
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        requests = command.args["requests"]
        mine = [i for i in range(len(requests)) if i % size == rank]
        try:
            results = self.samplers.sample(command.args["sampler_id"], [requests[i] for i in mine])
            payload: tuple = (True, list(zip(mine, results, strict=True)))
        except Exception as exc:  # every rank still joins the gather below
            payload = (False, exc if isinstance(exc, UserInputError) else RuntimeError(f"{type(exc).__name__}: {exc}"))
        parts = gather_object_to(payload, group, dst=0)
        if parts is None:
            return None
        failed = [error for ok, error in parts if not ok]
        if failed:
            raise failed[0]
        out: list[PromptSamples | None] = [None] * len(requests)
        for _, pairs in parts:
            for i, result in pairs:
                out[i] = result
        return out  # type: ignore[return-value]

    def _forward_backward(self, command: Command):
        a = command.args
        result = self._trainer(command).forward_backward(
            a["data"], a["loss_fn"], a["loss_config"], forward_only=a["forward_only"]
        )
        return result.outputs, result.metrics
