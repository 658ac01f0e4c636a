"""What every rank does with a command: one :class:`~ringtune.engine.trainer.Trainer` per training run.

This module holds the training commands (create, free, forward(_backward), one pass of several LoRA runs,
optimizer step, save, load, export) and routes the others: sampling sessions to the rank's
:class:`~ringtune.sample.pool.SamplerPool`, ``sample`` / ``sample_more`` to its decode jobs
(:mod:`ringtune.worker.decode_jobs`, long prompts through :mod:`ringtune.worker.mesh_prefill`), ``probe`` to
:mod:`ringtune.worker.served_probes`; after a failure inside a collective the data groups are rebuilt
(:mod:`ringtune.worker.group_repair`).

Every rank of the mesh holds a replica (or FSDP shard) of each live run and executes each command with the
same arguments; the engine's collectives keep them in step. Every command ends with an agreement over the
mesh's control group (:func:`ringtune.parallel.control.agreed_call`): all ranks raise the same error or none
does, and the command channel relies on that to recycle its messages.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ringtune.engine.lora_batch import forward_backward_many
from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.sharding import check_sharding
from ringtune.engine.trainer import Trainer
from ringtune.errors import ParallelConfigError, ServerConfigError, UserInputError
from ringtune.models.checkpoints.load import load_model
from ringtune.models.decoder import CausalLM
from ringtune.models.precision import PRECISIONS, Precision, check_precision
from ringtune.ops.cp_modes import DEFAULT_ATTENTION, DEFAULT_GATED_DELTA
from ringtune.parallel.control import agreed_call
from ringtune.parallel.mesh import ParallelMesh
from ringtune.sample.mesh_prompts import MeshLayout, PromptForward
from ringtune.sample.pool import SampleRequest, SamplerPool, tokenizer_decoder
from ringtune.worker.commands import Command
from ringtune.worker.decode_jobs import DecodeJobs
from ringtune.worker.group_repair import repair_groups
from ringtune.worker.lora_runs import SharedBase
from ringtune.worker.mesh_prefill import prefill_on_mesh
from ringtune.worker.served_probes import run_served_probe


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How every rank builds a run's model and trainer (identical on every rank).

    Attributes:
        source: what :func:`load_model` reads (HF dir, ``.gguf`` file, or the embedded default name).
        name: the name clients pass as ``base_model`` (``--model NAME=PATH`` or ``--model-name``); None: ``source``.
        dtype: the precision's name, a key of :data:`~ringtune.models.precision.PRECISIONS` (``float32``,
            ``bfloat16``, ``float64``, ``bf16-mixed``): parameter and compute dtypes.
        max_tokens_per_rank: the engine's per-rank token budget.
        trainer_options: keyword arguments of :class:`Trainer` (``attention``, ``gated_delta``, ...).
        tokenizer_dir: the served tokenizer (stop strings are matched on decoded text), or None.
        mesh_prompt_tokens: a ``max_tokens=1`` sampling request (``compute_logprobs``) whose prompt has at
            least this many tokens runs through the DP×CP forward (:mod:`ringtune.sample.mesh_prompts`);
            None: the per-rank budget.
        record_routing: sampled sequences carry their MoE routing (``--routing-replay``; the gateway replays it).
        shared_decode: sampling requests on one base model (any session, any LoRA adapter) decode in one
            batch per rank (``--shared-decode``, :mod:`ringtune.sample.shared_decode`).
        device_type: ``cpu`` or ``cuda`` (:func:`~ringtune.worker.device_defaults.resolve_device_settings`):
            where every rank's models, caches and inputs live (a rank's ``mesh.device``; one process without a
            mesh: ``cuda:0`` or the CPU).
    """

    source: str
    dtype: str
    max_tokens_per_rank: int
    name: str | None = None
    trainer_options: Mapping[str, Any] = field(default_factory=dict)
    tokenizer_dir: str | None = None
    mesh_prompt_tokens: int | None = None
    record_routing: bool = False
    shared_decode: bool = True
    device_type: str = "cpu"

    def device(self, mesh: ParallelMesh | None) -> torch.device:
        """The one device of this rank's tensors: ``mesh.device``, or without a mesh ``cuda:0`` / the CPU."""
        if mesh is not None:
            return mesh.device
        return torch.device("cuda", 0) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def served_name(self) -> str:
        """The model's name among the served models (``name``, else ``source``)."""
        return self.name or self.source

    @property
    def modes(self) -> dict[str, Any]:
        """The :class:`Trainer` options that shape the numbers, with their defaults (``BackendInfo.modes``)."""
        options = self.trainer_options
        return {
            "attention": options.get("attention", DEFAULT_ATTENTION),
            "gated_delta": options.get("gated_delta", DEFAULT_GATED_DELTA),
            "pad_multiplier": int(options.get("pad_multiplier", PAD_MULTIPLIER)),
            "debug_fault": options.get("debug_fault"),
            "shard_params": check_sharding(options.get("shard_params", False)),
            "recompute": options.get("recompute", "none"),
            "device_type": self.device_type,
        }

    @property
    def min_mesh_prompt_tokens(self) -> int:
        """The prompt length from which ``max_tokens=1`` requests run on the whole mesh."""
        return self.max_tokens_per_rank if self.mesh_prompt_tokens is None else self.mesh_prompt_tokens


PAD_MULTIPLIER = 8
"""The per-rank stream pad multiple the engine uses unless ``trainer_options`` says otherwise."""

DTYPES = {name: p.param_dtype for name, p in PRECISIONS.items()}
"""Parameter dtype of each precision name (the dtype models are loaded in)."""


def trainer_dtype_options(precision: Precision) -> dict[str, Any]:
    """The :class:`Trainer` keyword arguments a precision adds (``compute_dtype`` when mixed, and
    ``exact_arithmetic`` when exact)."""
    if not precision.mixed:
        return {}
    return {"compute_dtype": precision.compute_dtype} | ({"exact_arithmetic": True} if precision.exact else {})


class RankExecutor:
    """This rank's live runs of one served model and how it executes each :class:`Command` (collective over the
    mesh); several models on one mesh: :class:`~ringtune.worker.served_models.ServedModels` holds one per model.

    ``spare``: a copy of the model rank 0 already loaded (the first run takes it). ``mesh_trainers``: every run
    on the mesh (all served models'), whose FSDP-sharded ones a group repair marks broken; None: this executor's.
    """

    def __init__(
        self,
        spec: ModelSpec,
        mesh: ParallelMesh | None,
        *,
        spare: CausalLM | None = None,
        mesh_trainers: Callable[[], Iterable[Trainer]] | None = None,
    ) -> None:
        self.precision = check_precision(spec.dtype)
        check_sharding(spec.trainer_options.get("shard_params", False), field="trainer_options.shard_params")
        self.spec, self.mesh = spec, mesh
        self.device = spec.device(mesh)
        self.trainers: dict[str, Trainer] = {}
        self._spare = spare
        self._mesh_trainers = mesh_trainers or (lambda: self.trainers.values())
        self.lora_base = SharedBase(self._take_model)
        self.samplers = SamplerPool(
            lambda path: load_model(path or spec.source, dtype=self.precision.param_dtype, device=self.device),
            decode=tokenizer_decoder(spec.tokenizer_dir),
            compute_dtype=self.precision.compute_dtype if self.precision.mixed else None,
            exact=self.precision.exact,
            record_routing=spec.record_routing,
            shared_decode=spec.shared_decode,
        )
        self.decode_jobs = DecodeJobs(
            self.samplers,
            mesh,
            min_mesh_prompt_tokens=spec.min_mesh_prompt_tokens,
            prefill_on_mesh=self._prefill_on_mesh,
        )
        """Sampling requests decoding across commands (``sample`` starts a job, ``sample_more`` continues it)."""
        self.handlers: dict[str, Callable[[Command], Any]] = {
            "create_run": self._create_run,
            "free_run": self._free_run,
            "forward_backward": self._forward_backward,
            "forward_backward_many": self._forward_backward_many,
            "optim_step": lambda c: self._trainer(c).optim_step(c.args["adam"]),
            "save_state": lambda c: self._trainer(c).save_state(c.args["path"]),
            "load_state": lambda c: self._trainer(c).load_state(c.args["path"], optimizer=c.args["optimizer"]),
            "export_hf": lambda c: self._trainer(c).export_hf(c.args["path"]),
            "create_sampler": lambda c: self.samplers.create(c.args["sampler_id"], c.args["source"], self.trainers),
            "free_sampler": lambda c: self.samplers.free(c.args["sampler_id"]),
            "sample": lambda c: self.decode_jobs.start(c.args),
            "sample_more": lambda c: self.decode_jobs.more(c.args),
            "probe": lambda c: run_served_probe(c.args["name"], self.mesh, spec.modes, self.precision.compute_dtype),
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
        options = {**self.spec.trainer_options, **trainer_dtype_options(self.precision)}
        if command.args.get("lora") is not None:  # a LoRA run: adapters on the base every LoRA run shares
            self.trainers[command.run_id] = self.lora_base.trainer(
                command.args["lora"], self.mesh, max_tokens_per_rank=self.spec.max_tokens_per_rank, **options
            )
            return
        model = self._take_model()
        try:
            trainer = Trainer(model, self.mesh, max_tokens_per_rank=self.spec.max_tokens_per_rank, **options)
        except ParallelConfigError as exc:  # the server's modes, not the client's request (preflight missed it)
            raise ServerConfigError(f"the server's configuration cannot train this model: {exc}") from exc
        self.trainers[command.run_id] = trainer

    def _take_model(self) -> CausalLM:
        """A model of its own for a full fine-tuning run, or the frozen base of LoRA runs: the spare copy rank 0
        loaded to describe the model when no run took it yet, else loaded (collective); under expert
        parallelism with this rank's experts only (the trainer keeps just those)."""
        spare, self._spare = self._spare, None
        ep = (self.mesh.ep_rank, self.mesh.ep_size) if self.mesh is not None and self.mesh.ep_size > 1 else None
        return agreed_call(
            lambda: (
                spare
                if spare is not None
                else load_model(self.spec.source, dtype=self.precision.param_dtype, ep=ep, device=self.device)
            ),
            self.mesh.control_group if self.mesh else None,
        )

    def _free_run(self, command: Command) -> None:
        trainer = self.trainers.pop(command.run_id or "", None)
        if trainer is not None:
            self.lora_base.forget(trainer)  # a LoRA run's adapters may still be the base's active ones
            gc.collect()

    def _prefill_on_mesh(self, sampler_id: str, requests: list[SampleRequest]) -> dict[int, PromptForward]:
        """Long prompts of session ``sampler_id`` through the DP×CP forward (:func:`prefill_on_mesh`)."""
        modes = self.spec.modes
        layout = MeshLayout(
            max_tokens_per_rank=self.spec.max_tokens_per_rank,
            attention=modes["attention"],
            gated_delta=modes["gated_delta"],
            pad_multiplier=modes["pad_multiplier"],
        )
        model = self.samplers.model(sampler_id)
        return prefill_on_mesh(
            model, self.mesh, layout, requests, lambda: repair_groups(self.mesh, self._mesh_trainers())
        )

    def _forward_backward_many(self, command: Command) -> list[Any]:
        """Several LoRA runs' requests in one pass (:func:`ringtune.engine.lora_batch.forward_backward_many`):
        per run ``(outputs, metrics)`` or the message of its UserInputError."""
        a = command.args
        trainers = []
        for run_id in a["run_ids"]:
            trainer = self._trainer(Command("forward_backward", run_id, {}))
            if not isinstance(trainer, LoraTrainer):
                raise UserInputError(f"run {run_id!r} is not a LoRA run; only LoRA runs share a forward pass")
            trainers.append(trainer)
        outcomes = forward_backward_many(
            trainers, a["data"], a["loss_fn"], a["loss_config"], forward_only=a["forward_only"]
        )
        return [str(o) if isinstance(o, UserInputError) else (o.outputs, o.metrics) for o in outcomes]

    def _forward_backward(self, command: Command) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """One run's forward(_backward) (:meth:`Trainer.forward_backward`): (per-datum outputs, metrics)."""
        a = command.args
        result = self._trainer(command).forward_backward(
            a["data"], a["loss_fn"], a["loss_config"], forward_only=a["forward_only"]
        )
        return result.outputs, result.metrics
