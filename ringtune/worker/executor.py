"""What every rank does with a command: one :class:`~ringtune.engine.trainer.Trainer` per training run.

Every rank of the mesh holds a replica (or FSDP shard) of each live run and executes each command with the
same arguments; the engine's collectives keep them in step. Every command ends with an agreement over the
mesh's control group (:func:`ringtune.parallel.control.agreed_call`): all ranks raise the same error or none
does, and the command channel relies on that to recycle its messages.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringtune.engine.lora_batch import forward_backward_many
from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.sharding import check_sharding
from ringtune.engine.trainer import SHARDED_GROUPS_LOST, Trainer
from ringtune.errors import ParallelConfigError, ServerConfigError, UserInputError
from ringtune.models.checkpoints.load import load_model
from ringtune.models.decoder import CausalLM
from ringtune.models.precision import PRECISIONS, Precision, check_precision
from ringtune.ops.cp_modes import DEFAULT_ATTENTION, DEFAULT_GATED_DELTA
from ringtune.parallel.control import (
    RankFailedError,
    agreed_call,
    all_gather_objects,
    attempt,
    gather_object_to,
)
from ringtune.parallel.mesh import ParallelMesh, rebuild_mesh
from ringtune.probes.ring_accumulation import (
    MISMATCH_LIMIT,
    SERVED_PROBES,
    mismatch_fraction,
    ring_accumulation_counts,
)
from ringtune.sample.alt_tokens import AltDraws
from ringtune.sample.mesh_prompts import MeshLayout, PromptForward, prompts_forward, takes_mesh_forward
from ringtune.sample.params import DEFAULT_MAX_TOKENS
from ringtune.sample.pool import PoolGeneration, SampleRequest, SamplerPool, tokenizer_decoder
from ringtune.sample.request_checks import check_request, check_targets
from ringtune.sample.sampler import PromptSamples
from ringtune.worker.commands import Command
from ringtune.worker.lora_runs import SharedBase


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How every rank builds a run's model and trainer (identical on every rank).

    Attributes:
        source: what :func:`load_model` reads (HF dir, ``.gguf`` file, or the embedded default name).
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
    """

    source: str
    dtype: str
    max_tokens_per_rank: int
    trainer_options: Mapping[str, Any] = field(default_factory=dict)
    tokenizer_dir: str | None = None
    mesh_prompt_tokens: int | None = None
    record_routing: bool = False
    shared_decode: bool = True

    @property
    def modes(self) -> dict[str, Any]:
        """The :class:`Trainer` options that shape the numbers, with their defaults (``BackendInfo.modes``)."""
        options = self.trainer_options
        return {
            "attention": options.get("attention", DEFAULT_ATTENTION),
            "gated_delta": options.get("gated_delta", DEFAULT_GATED_DELTA),
            "pad_multiplier": int(options.get("pad_multiplier", PAD_MULTIPLIER)),
            "debug_fault": options.get("debug_fault"),
        }

    @property
    def min_mesh_prompt_tokens(self) -> int:
        """The prompt length from which ``max_tokens=1`` requests run on the whole mesh."""
        return self.max_tokens_per_rank if self.mesh_prompt_tokens is None else self.mesh_prompt_tokens


PAD_MULTIPLIER = 8
"""The per-rank stream pad multiple the engine uses unless ``trainer_options`` says otherwise."""

DTYPES = {name: p.param_dtype for name, p in PRECISIONS.items()}
"""Parameter dtype of each precision name (the dtype models are loaded in)."""


@dataclass(frozen=True)
class DecodeJob:
    """This rank's share of one ``sample`` command while it decodes across commands: the command's request
    count, the indices of the requests this rank decodes, and their generation."""

    count: int
    mine: list[int]
    generation: PoolGeneration


def trainer_dtype_options(precision: Precision) -> dict[str, Any]:
    """The :class:`Trainer` keyword arguments a precision adds (``compute_dtype`` when mixed, and
    ``exact_arithmetic`` when exact)."""
    if not precision.mixed:
        return {}
    return {"compute_dtype": precision.compute_dtype} | ({"exact_arithmetic": True} if precision.exact else {})


class RankExecutor:
    """This rank's live runs and how it executes each :class:`Command` (collective over the mesh)."""

    def __init__(
        self,
        spec: ModelSpec,
        mesh: ParallelMesh | None,
        *,
        spare: CausalLM | None = None,
    ) -> None:
        self.precision = check_precision(spec.dtype)
        check_sharding(spec.trainer_options.get("shard_params", False), field="trainer_options.shard_params")
        self.spec, self.mesh = spec, mesh
        self.trainers: dict[str, Trainer] = {}
        self._spare = spare
        self.lora_base = SharedBase(self._take_model)
        self.decode_jobs: dict[str, DecodeJob] = {}  # sampling requests decoding across commands, by job id
        self._next_decode_rank = 0  # the rank the next job's first short request decodes on
        self.samplers = SamplerPool(
            lambda path: load_model(path or spec.source, dtype=self.precision.param_dtype),
            decode=tokenizer_decoder(spec.tokenizer_dir),
            compute_dtype=self.precision.compute_dtype if self.precision.mixed else None,
            exact=self.precision.exact,
            record_routing=spec.record_routing,
            shared_decode=spec.shared_decode,
        )
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
            "sample": self._sample,
            "sample_more": self._sample_more,
            "probe": self._probe,
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
                spare if spare is not None else load_model(self.spec.source, dtype=self.precision.param_dtype, ep=ep)
            ),
            self.mesh.control_group if self.mesh else None,
        )

    def _free_run(self, command: Command) -> None:
        trainer = self.trainers.pop(command.run_id or "", None)
        if trainer is not None:
            self.lora_base.forget(trainer)  # a LoRA run's adapters may still be the base's active ones
            gc.collect()

    def _sample(self, command: Command) -> list[PromptSamples] | None:
        """Start decode job ``job_id`` for every request of the command and run its first slice
        (:meth:`_advance`): the answers on the result rank in request order once every rank finished (None
        elsewhere, and None on every rank while the job goes on: ``sample_more`` continues it).

        Requests with long prompts (:func:`takes_mesh_forward`) run their prompts together on the whole mesh
        (:meth:`_prefill_on_mesh`) and are decoded by the rank each prompt was given to; the others are
        spread round-robin over the ranks, each prefilling and decoding its share on its own snapshot
        replica (:meth:`SamplerPool.begin`), continuing where the previous job's stopped. ``slice_s`` None:
        the job runs to the end in this command.
        """
        requests: list[SampleRequest] = command.args["requests"]
        sampler_id = command.args["sampler_id"]
        job_id = command.args.get("job_id") or "sample"
        if job_id in self.decode_jobs:
            raise ValueError(f"decode job {job_id!r} already exists")
        group = self.mesh.control_group if self.mesh else None
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        limit = self.spec.min_mesh_prompt_tokens
        long = [takes_mesh_forward(len(r.prompt), min_prompt_tokens=limit) for r in requests]
        on_mesh = [i for i, is_long in enumerate(long) if is_long]
        spread = [i for i, is_long in enumerate(long) if not is_long]
        prefilled = self._prefill_on_mesh(sampler_id, [requests[i] for i in on_mesh]) if on_mesh else {}
        # round-robin from where the previous job stopped (the same count on every rank: commands are
        # replicated), so that one-request jobs do not all land on rank 0
        first = self._next_decode_rank
        self._next_decode_rank = (first + len(spread)) % size
        mine = [on_mesh[j] for j in sorted(prefilled)] + [i for n, i in enumerate(spread) if (first + n) % size == rank]

        def begin() -> DecodeJob:
            forwards = [prefilled[j] for j in sorted(prefilled)] + [None] * (len(mine) - len(prefilled))
            generation = self.samplers.begin(sampler_id, [requests[i] for i in mine], prefilled=forwards)
            return DecodeJob(len(requests), mine, generation)

        job, error = attempt(begin)
        return self._advance(job_id, job, error, command.args.get("slice_s"))

    def _sample_more(self, command: Command) -> list[PromptSamples] | None:
        """The next slice of decode job ``job_id`` (:meth:`_advance`); a job this rank does not hold (lost
        when the worker ranks restarted) fails the request as a server error."""
        job_id = command.args["job_id"]
        job = self.decode_jobs.get(job_id)
        error = None if job is not None else RuntimeError(f"decode job {job_id!r} is gone (the worker ranks restarted)")
        return self._advance(job_id, job, error, command.args.get("slice_s"))

    def _advance(
        self, job_id: str, job: DecodeJob | None, error: BaseException | None, slice_s: float | None
    ) -> list[PromptSamples] | None:
        """Decode this rank's share of ``job`` for ``slice_s`` seconds (None: to the end), then agree over the
        control group whether every rank finished: if so the answers are gathered to the result rank (in
        request order; None elsewhere) and the job is dropped; if any rank failed the job is dropped and the
        error raised; otherwise the job is kept and None returned. Decoding itself is local to each rank."""
        if error is None and job is not None:
            deadline = None if slice_s is None else time.monotonic() + slice_s
            _, error = attempt(lambda: job.generation.advance(deadline))
        group = self.mesh.control_group if self.mesh else None
        states = all_gather_objects(None if error is not None else job.generation.finished, group)  # type: ignore[union-attr]
        if any(state is None for state in states):
            self.decode_jobs.pop(job_id, None)
            if job is not None:  # its rows leave the rank's shared decode batch
                job.generation.close()
            if error is not None:
                raise error
            raise RankFailedError("another rank failed while decoding a sampling request")
        if not all(states):
            self.decode_jobs[job_id] = job  # type: ignore[assignment]
            return None
        self.decode_jobs.pop(job_id, None)
        assert job is not None
        parts = gather_object_to(list(zip(job.mine, job.generation.results(), strict=True)), group, dst=0)
        if parts is None:
            return None
        answers = {i: result for pairs in parts for i, result in pairs}
        return [answers[i] for i in range(job.count)]

    def _prefill_on_mesh(self, sampler_id: str, requests: list[SampleRequest]) -> dict[int, PromptForward]:
        """The prompts of ``requests`` through the DP×CP forward of the session's snapshot (every rank holds
        the same one); ``{request index: PromptForward}`` of the requests this rank decodes, with their
        caches when they generate more than one token. Collective over the whole mesh.

        Requests are checked before any collective (the same verdict on every rank). A rank failing in
        the forward leaves its peers' data groups out of step: after the ranks agree on it, the groups
        are rebuilt, as the trainer does.
        """
        model = self.samplers.model(sampler_id)
        vocab = model.config.vocab_size
        for r in requests:
            alt_k = r.prompt_alt_tokens_k
            check_request([r.prompt], vocab, r.num_samples, r.topk_prompt_logprobs, 1, r.topk_sample_logprobs, alt_k)
            if alt_k and r.params.seed is None:
                raise ValueError("prompt_alt_tokens_k on the mesh needs a fixed seed (SampleRequest.with_fixed_seed)")
            if r.target_tokens is not None:
                check_targets([r.target_tokens], [list(r.prompt)], vocab)
        modes = self.spec.modes
        layout = MeshLayout(
            max_tokens_per_rank=self.spec.max_tokens_per_rank,
            attention=modes["attention"],
            gated_delta=modes["gated_delta"],
            pad_multiplier=modes["pad_multiplier"],
        )
        groups: dict[tuple[bool, int, int, bool, int, float], list[int]] = {}
        for i, r in enumerate(requests):
            decodes = (r.params.max_tokens or DEFAULT_MAX_TOKENS) > 1
            alt = (r.prompt_alt_tokens_k, r.params.temperature if r.prompt_alt_tokens_k else 0.0)
            groups.setdefault((r.prompt_logprobs, r.topk_prompt_logprobs, r.target_k, decodes, *alt), []).append(i)
        forwards: dict[int, PromptForward] = {}

        def run() -> None:
            for (want_lp, topk, target_k, decodes, alt_k, temperature), members in groups.items():
                prompts = [requests[i].prompt for i in members]
                targets = [requests[i].target_tokens for i in members] if target_k else None
                alt = None
                if alt_k:  # every seed was checked above: fixed, the same on every rank
                    seeds = tuple(int(requests[i].params.seed) for i in members)  # type: ignore[arg-type]
                    alt = AltDraws(alt_k, temperature, seeds)
                got = prompts_forward(
                    model,
                    self.mesh,
                    prompts,
                    layout,
                    prompt_logprobs=want_lp,
                    topk=topk,
                    capture=decodes,
                    targets=targets,  # type: ignore[arg-type]
                    alt=alt,
                )
                forwards.update((members[j], forward) for j, forward in got.items())

        _, error = attempt(run)
        control = self.mesh.control_group if self.mesh else None
        verdicts = all_gather_objects(None if error is None else isinstance(error, UserInputError), control)
        if any(v is False for v in verdicts):  # a rank failed inside a collective: fresh data groups
            self._repair_groups()
        if error is not None:
            raise error
        if any(v is not None for v in verdicts):
            raise RankFailedError("another rank failed in the prompt forward of a sampling request")
        return forwards

    def _probe(self, command: Command) -> dict[str, Any] | None:
        """A served probe (:data:`SERVED_PROBES`) on every rank with the server's own modes, compute dtype,
        device and debug fault; the summary on the result rank (None elsewhere). Collective over the mesh
        (each DP replica's CP group runs it, the counts are gathered over the control group)."""
        name = command.args["name"]
        if name not in SERVED_PROBES:
            raise UserInputError(f"probe={name!r} is not a served probe; choose one of {list(SERVED_PROBES)}")
        modes = self.spec.modes
        dtype = self.precision.compute_dtype
        cp_size = self.mesh.cp_size if self.mesh else 1
        summary: dict[str, Any] = {"probe": name, "cp": cp_size, "dtype": str(dtype).removeprefix("torch.")}
        summary |= {"attention": modes["attention"], "limit": MISMATCH_LIMIT}
        if modes["attention"] != "ring":
            return summary | {"applies": False, "why": f"attention mode {modes['attention']!r} has no ring hops"}
        counts = ring_accumulation_counts(
            self.mesh.cp_group if self.mesh and cp_size > 1 else None,
            cp_size=cp_size,
            cp_rank=self.mesh.cp_rank if self.mesh else 0,
            dtype=dtype,
            device=self.mesh.device if self.mesh else torch.device("cpu"),
            fault=modes["debug_fault"],
        )
        parts = gather_object_to(counts, self.mesh.control_group if self.mesh else None, dst=0)
        if parts is None:
            return None
        fractions = mismatch_fraction(parts)
        if fractions is None:
            return summary | {"applies": False, "why": f"{summary['dtype']} is its own accumulator dtype"}
        return summary | {"applies": True, "mismatch": fractions, "elements": sum(c["dk"][1] for c in parts if c)}

    def _repair_groups(self) -> None:
        """Fresh data groups on every rank of the mesh after a failure inside a collective (see the trainer's
        repair); a run whose parameters are FSDP-sharded cannot move to them and is marked broken."""
        if self.mesh is None:
            return
        rebuild_mesh(self.mesh)
        for trainer in self.trainers.values():
            if trainer.fsdp_units:
                trainer.broken = SHARDED_GROUPS_LOST

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

    def _forward_backward(self, command: Command):
        a = command.args
        result = self._trainer(command).forward_backward(
            a["data"], a["loss_fn"], a["loss_config"], forward_only=a["forward_only"]
        )
        return result.outputs, result.metrics
