"""The training engine: Tinker forward / forward_backward / optim_step over a DP×CP mesh, all-or-nothing.

Every rank of the mesh calls the same methods with the same request. A request is first turned into a
validated :class:`~ringtune.engine.batch.Batch` (a pure function: a user error is raised on every rank
alike, before any compute). Then each DP rank runs its microbatches, each a packed row split over the CP
group by the zigzag layout. Per-datum outputs are gathered to full length (one CP all-reduce per
microbatch) and collected on the result rank (rank 0 of the DP×CP group). Gradients accumulate locally
over calls and are SUMMED over DP×CP at optim_step, checked by the gradient invariant.

All-or-nothing: a request either completes on every rank or leaves weights, AdamW state, accumulated
gradients and the step unchanged on every rank, and every rank raises the same error. The ranks agree on
the outcome over the mesh's control group (:mod:`ringtune.parallel.control`) before anything is kept:

- forward_backward sets the gradients accumulated so far aside, runs the request into fresh ones, and
  adds them only when every rank succeeded and every loss and gradient is finite (else
  :class:`~ringtune.errors.NonFiniteError` naming the datums); otherwise it puts the old ones back;
- a rank that fails in the middle (a fault, a bug) leaves its peers waiting in a data collective until
  the mesh's timeout; after the agreement the data groups are rebuilt (their sequence numbers no longer
  match) and the trainer is usable again. A rank that died or hung is fatal: every later call raises.
- optim_step refuses a step whose summed gradient is not finite, whose weights are not finite, or whose AdamW
  update would make a weight or moment non-finite (a finite but huge gradient element overflows the second
  moment; each rank runs the update on copies first): weights, moments and step untouched on every rank; the
  accumulated gradients are dropped.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtune.debug_faults import check_fault, fault_hooks
from ringtune.engine import expert_parallel, sharding
from ringtune.engine.batch import MAX_TARGET_K, Batch, TrainDatum, build_batch
from ringtune.engine.checkpoint import export_hf_weights, load_checkpoint, save_checkpoint
from ringtune.engine.grad_stash import GradientStash, drop_gradients
from ringtune.engine.gradients import GradientInvariant
from ringtune.engine.memory import peak_memory_bytes
from ringtune.engine.optimizer import (
    AdamParams,
    apply_step,
    global_grad_norm,
    new_adamw,
    non_finite_update,
    prepare_step,
)
from ringtune.engine.replica_check import ReplicaCheck
from ringtune.engine.request_outcome import ForwardBackwardResult, non_finite_error
from ringtune.engine.routing_replay import replay_shards
from ringtune.errors import NonFiniteError, ParallelConfigError
from ringtune.layout.zigzag import zigzag_slice
from ringtune.losses import PER_TARGET_KEYS, fixed_logprob_gradient, local_token_losses
from ringtune.models.decoder import CausalLM
from ringtune.models.layers import moe_router_stats as router_stats
from ringtune.models.layers.moe import (
    gather_expert_state,
    is_expert_parameter,
    moe_blocks,
    moe_shape,
    named_moe_blocks,
    set_expert_parallel,
)
from ringtune.models.logprob_head import IGNORE_INDEX
from ringtune.models.precision import check_compute_dtype, export_dtype, set_compute_dtype
from ringtune.models.recompute import DEFAULT_RECOMPUTE, check_recompute_mode, set_recompute
from ringtune.models.shard import shard_of
from ringtune.ops.cp_modes import DEFAULT_ATTENTION, DEFAULT_GATED_DELTA
from ringtune.parallel.control import (
    NOT_CAUGHT,
    RankFailedError,
    agree,
    agreed_call,
    all_gather_objects,
    gather_object_to,
)
from ringtune.parallel.mesh import ParallelMesh, rebuild_mesh
from ringtune.parallel.row_gather import gather_row

SHARDED_GROUPS_LOST = "a rank failed mid-request and FSDP-sharded parameters cannot move to new groups"
"""Why a sharded trainer is broken once the mesh's data groups were rebuilt (its DeviceMesh holds the old ones)."""

__all__ = ["ForwardBackwardResult", "TrainDatum", "Trainer"]


class Trainer:
    """Owns the model replica of this rank, its AdamW state and the gradient invariant.

    Args:
        model: this rank's replica (identical on every rank of the DP×CP group).
        mesh: the DP×CP mesh, or None for a single process.
        max_tokens_per_rank: the per-rank token budget of a microbatch.
        attention, gated_delta: CP modes (names from :mod:`ringtune.ops.cp_modes`; checked against the
            model's heads here, at build time).
        pad_multiplier: the per-rank stream is padded to a multiple of this.
        max_target_k: cap on K of ``[N, K]`` targets.
        fault: a unit-test negative control from :data:`ringtune.debug_faults.TEST_FAULTS` (the gradient
            invariant's, and ``fsdp_default_divide`` in :mod:`ringtune.engine.sharding`); None in normal use.
        debug_fault: a parity negative control from :data:`ringtune.debug_faults.DEBUG_FAULTS` (``ringtune serve
            --debug-fault``, hidden); None in normal use. At most one of ``fault`` and ``debug_fault``.
        shard_params: a name of :data:`ringtune.engine.sharding.SHARDINGS`: ``"none"`` (replicated), ``"dp"``
            (FSDP2 over DP, replicated over CP) or ``"dp_cp"`` (FSDP2 over all DP×CP ranks); ``False``/``True``
            mean ``"none"``/``"dp"`` (as before the registry). Sharded: parameters, gradients and AdamW state are
            DTensors split over the shard group, gradients are SUMMED by FSDP during backward (start-up probe
            checked); same numbers as the replicated engine. UserInputError for another value.
        recompute: activation recomputation per decoder layer, ``none`` / ``full`` / ``selective``
            (:mod:`ringtune.models.recompute`); same gradients, less activation memory, more compute.
        router_aux_loss_coef: the MoE load-balancing auxiliary loss's weight (``--router-aux-loss-coef``; 0, the
            default, adds nothing: Tinker's losses have no auxiliary term), computed per packed row over its real
            tokens, CP-invariant (:mod:`ringtune.models.layers.moe_router_stats`). forward_backward also reports
            ``moe/layer{i}/load_max_over_mean:max`` per MoE layer over the request's tokens.
        compute_dtype: mixed precision (:mod:`ringtune.models.precision`): the decoder layers compute in this
            dtype (bfloat16) while the float32 parameters, gradients and AdamW moments stay float32 masters;
            None (default) computes in the parameters' dtype. HF exports are then written in the checkpoint's
            original dtype.
        exact_arithmetic: with ``compute_dtype``, the layers compute in float64 between roundings to it
            (``bf16-exact``: batch-, layout- and CP-invariant bits, :mod:`ringtune.models.precision`).
        adamw_kernel: a name of :data:`ringtune.engine.optimizer.ADAMW_KERNELS`; None (default): ``fused`` on
            CUDA, torch's default on CPU.

    Attributes:
        faults: this rank's debug-fault hooks (:class:`~ringtune.debug_faults.FaultHooks`; ``NO_FAULTS`` in normal
            use); a test injects a failure with ``replace(trainer.faults, before_microbatch=hook)``.
    """

    def __init__(
        self,
        model: CausalLM,
        mesh: ParallelMesh | None,
        *,
        max_tokens_per_rank: int,
        attention: str = DEFAULT_ATTENTION,
        gated_delta: str = DEFAULT_GATED_DELTA,
        pad_multiplier: int = 8,
        max_target_k: int = MAX_TARGET_K,
        fault: str | None = None,
        shard_params: bool | str = False,
        debug_fault: str | None = None,
        recompute: str = DEFAULT_RECOMPUTE,
        compute_dtype: torch.dtype | None = None,
        exact_arithmetic: bool = False,
        router_aux_loss_coef: float = 0.0,
        adamw_kernel: str | None = None,
    ) -> None:
        set_recompute(model, check_recompute_mode(recompute))
        self.compute_dtype = check_compute_dtype(model, compute_dtype)
        self.exact_arithmetic = exact_arithmetic and self.compute_dtype is not None
        # before sharding: FSDP's start-up probe compares like with like
        set_compute_dtype(model, self.compute_dtype, exact=self.exact_arithmetic)
        self.export_dtype = export_dtype(model, self.compute_dtype)
        self.recompute = recompute
        self.model = model
        self.router_aux_loss_coef = router_stats.check_aux_coef(moe_blocks(model), router_aux_loss_coef)
        self.debug_fault = check_fault(debug_fault)
        if fault is not None and debug_fault is not None:
            raise ValueError(f"fault={fault!r} and debug_fault={debug_fault!r}: inject at most one")
        self.mesh = mesh
        self.dp_size, self.dp_rank = (mesh.dp_size, mesh.dp_rank) if mesh else (1, 0)
        self.cp_size, self.cp_rank = (mesh.cp_size, mesh.cp_rank) if mesh else (1, 0)
        self.control_group = mesh.control_group if mesh else None
        self.max_tokens_per_rank = max_tokens_per_rank
        self.attention, self.gated_delta = attention, gated_delta
        self.pad_multiplier = pad_multiplier
        self.max_target_k = max_target_k
        model.config.check_parallel(cp_size=self.cp_size, attention=attention, gated_delta=gated_delta)
        self.fsdp_units: list = []
        self.shard_params = sharding.check_sharding(shard_params)
        expert_parallel.setup(model, mesh, self.shard_params)  # EP > 1: this rank keeps 1/EP of the experts
        if self.shard_params != "none":
            if mesh is None:
                raise ParallelConfigError(
                    f"shard_params={self.shard_params!r} needs a mesh (it shards over it); got None"
                )
            modes = {"attention": attention, "gated_delta": gated_delta, "sharding": self.shard_params}
            # Exact arithmetic keeps float32 unsharded parameters: its layers round them themselves, and a bf16
            # unsharded gradient would round each rank's share (the replicated engine does not).
            fsdp_dtype = None if self.exact_arithmetic else self.compute_dtype
            self.fsdp_units = sharding.shard_params(model, mesh, **modes, fault=fault, compute_dtype=fsdp_dtype)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.adamw_kernel = adamw_kernel
        self.optimizer = new_adamw(self.params, adamw_kernel)
        expert_group = (lambda: self.mesh.expert_replica_group) if expert_parallel.ep_size(mesh) > 1 else None
        # The one debug-fault hooks object of this trainer (:mod:`ringtune.debug_faults`; NO_FAULTS in normal use).
        self.faults = fault_hooks(check_fault(debug_fault or fault), cp_size=self.cp_size, cp_rank=self.cp_rank)
        self.invariant = GradientInvariant(lambda: self.dp_cp_group, faults=self.faults, expert_group=expert_group)
        self.invariant.startup_check()
        self.replicas = ReplicaCheck(mesh, self.shard_params)  # replicas compared after every optim_step
        self.step = 0
        self.weights_version = 0  # bumped whenever the weights change (a sampler snapshot of them is then stale)
        self.broken: str | None = None

    def view(self, *, model: nn.Module, params: list[torch.nn.Parameter], invariant: Any) -> Trainer:
        """A shallow copy of this trainer that runs :meth:`run_batch` on another ``model`` (several LoRA runs'
        :class:`~ringtune.models.lora_mixed.MixedLoraModel`), accumulating into ``params`` and counting
        microbatches on ``invariant`` (:class:`~ringtune.engine.lora_batch.InvariantGroup`); mesh, modes and
        options are this trainer's. Only for :meth:`run_batch`: its optimizer is not the params'."""
        other = copy.copy(self)
        other.model, other.params, other.invariant = model, params, invariant
        other.names = {id(p): n for n, p in model.named_parameters()}
        return other

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The CP group, read from the mesh at each use (:func:`rebuild_mesh` may replace it)."""
        return self.mesh.cp_group if self.mesh else None

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.dp_cp_group if self.mesh else None

    @property
    def is_result_rank(self) -> bool:
        """True on the one rank that returns results (rank 0 of the DP×CP group)."""
        return self.control_group is None or dist.get_rank(self.control_group) == 0

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RankFailedError(f"this trainer can no longer run requests: {self.broken}; restart the server")
        self.replicas.require_trusted()

    # ------------------------------------------------------------------ requests

    def build_batch(self, data: Sequence[Any], loss_fn: str, loss_config: Mapping[str, Any] | None) -> Batch:
        """The validated, planned request (pure; raises UserInputError). See :mod:`ringtune.engine.batch`."""
        return build_batch(
            data,
            loss_fn,
            loss_config,
            vocab_size=self.model.config.vocab_size,
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            max_tokens_per_rank=self.max_tokens_per_rank,
            pad_multiplier=self.pad_multiplier,
            max_target_k=self.max_target_k,
            moe_shape=moe_shape(self.model),
        )

    def forward_backward(
        self,
        data: Sequence[Any],
        loss_fn: str,
        loss_config: Mapping[str, Any] | None = None,
        *,
        forward_only: bool = False,
    ) -> ForwardBackwardResult:
        """Tinker ``forward_backward`` (or ``forward`` with ``forward_only``); collective over the whole mesh.

        Gradients are added to this rank's local accumulators (reduced at :meth:`optim_step`) only if the
        request succeeds on every rank. Raises UserInputError (before any compute) for an invalid request,
        NonFiniteError for a non-finite loss or gradient, RankFailedError when another rank failed; in
        every case on every rank, with nothing changed.
        """
        self._check_usable()
        batch = agreed_call(lambda: self.build_batch(data, loss_fn, loss_config), self.control_group)
        return self.run_batch(batch, forward_only=forward_only)

    def forward(self, data: Sequence[Any], loss_fn: str = "cross_entropy", loss_config=None) -> ForwardBackwardResult:
        """Tinker ``forward``: outputs and loss, no gradients (accumulated ones are left alone)."""
        return self.forward_backward(data, loss_fn, loss_config, forward_only=True)

    def run_batch(self, batch: Batch, *, forward_only: bool = False) -> ForwardBackwardResult:
        """Run a validated :class:`Batch` (identical on every rank) all-or-nothing; see :meth:`forward_backward`."""
        self._check_usable()
        stash = None if forward_only else GradientStash.take(self.params, self.invariant)
        mine: dict[int, dict[str, torch.Tensor]] = {}
        loss_bad: set[int] = set()  # datums whose loss or log-probs are not finite
        grad_bad: set[int] = set()  # datums of the microbatch after which the gradient became non-finite
        error: BaseException | None = None
        count = batch.plan.microbatches_per_rank
        loads: dict[str, torch.Tensor] = {}  # per MoE layer: expert assignments of this rank's real tokens
        rows = zip(batch.plan.rows[self.dp_rank], batch.plan.local_lens[self.dp_rank], strict=True)
        try:
            for m, (row, local_len) in enumerate(rows):
                self.faults.microbatch_started(m)  # DEBUG-FAULT HOOK (failure injection in tests; no-op)
                out, bad_loss, bad_grad = self._microbatch(
                    batch, row, local_len, backward=not forward_only, flagged=bool(grad_bad)
                )
                mine.update(out)
                loads = router_stats.add_counts(loads, router_stats.layer_counts(named_moe_blocks(self.model)))
                loss_bad |= bad_loss
                grad_bad |= bad_grad
        except NOT_CAUGHT:
            raise
        except BaseException as exc:
            error = exc
        try:
            verdicts = all_gather_objects((error is not None, sorted(loss_bad), sorted(grad_bad)), self.control_group)
        except BaseException as exc:  # a rank died or hung: the mesh cannot agree any more
            if stash is not None:
                stash.restore()
            self.broken = f"the ranks could not agree ({type(exc).__name__}: {exc})"
            raise RankFailedError(f"a rank of the mesh died or hung: {exc}", error_type=type(exc).__name__) from exc
        repair = any(raised for raised, _, _ in verdicts)
        if error is None:
            error = non_finite_error(verdicts, batch, forward_only)
        try:
            agree(error, self.control_group)
        except BaseException:
            if stash is not None:
                stash.restore()
            if repair:
                self._repair()
            raise
        if stash is not None:
            stash.merge()
            self.invariant.count(count)
        result = self._collect(mine if self.cp_rank == 0 else {}, batch)
        if moe_blocks(self.model):  # expert load over the whole request (every rank's tokens)
            parts = gather_object_to(loads, self.control_group, dst=0)
            if parts is not None:
                result.metrics.update(router_stats.load_metrics(parts))
        return result

    # ------------------------------------------------------------------ one microbatch

    def _microbatch(
        self, batch: Batch, row: tuple[int, ...], local_len: int, *, backward: bool, flagged: bool
    ) -> tuple[dict[int, dict[str, torch.Tensor]], set[int], set[int]]:
        """Run one packed row (collective over the CP group).

        Returns ({datum index: outputs} full length, on every CP rank; the datums of this row whose loss
        or log-probs are not finite; all of the row's datums if the gradient became non-finite here).
        ``flagged``: a previous microbatch already made the gradient non-finite (not checked again).
        """
        members = [batch.datums[i] for i in row]
        lens = [d.num_tokens for d in members]
        shard = shard_of(
            lens,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            group=self.cp_group,
            attention=self.attention,
            gated_delta=self.gated_delta,
            pad_multiplier=self.pad_multiplier,
            pad_to=local_len,
        )
        plan = shard.plan
        if any(d.routing is not None for d in members):  # routing replay: zigzag-sliced like the tokens
            device = self.model.model.embed_tokens.weight.device
            shard = replace(shard, replay_experts=replay_shards(self.model, members, plan, device))
        if batch.adapter_of_datum is not None:  # several LoRA runs in one pass: each token's run, zigzag-sliced
            runs = torch.tensor([batch.adapter_of_datum[i] for i in row], dtype=torch.int64)
            per_token = torch.repeat_interleave(runs, torch.tensor(lens, dtype=torch.int64))
            device = self.model.model.embed_tokens.weight.device
            shard = replace(shard, adapter_index=zigzag_slice(per_token, plan, pad_value=-1).to(device))
        # Every datum carries exactly batch.input_keys (a pad-only row: empty tensors of the same trailing
        # shapes), so every rank runs the same loss code and the same collectives.
        k_shape = () if batch.target_k is None else (batch.target_k,)
        # the embedding's device, the head's too (a LoRA run's output_weight would merge a vocab x hidden tensor)
        device = self.model.model.embed_tokens.weight.device

        per_target = {"target_tokens", *PER_TARGET_KEYS.get(batch.loss.loss_fn, ())}

        def column(key: str, dtype: torch.dtype) -> torch.Tensor:
            empty = torch.zeros((0, *(k_shape if key in per_target else ())), dtype=dtype)
            return torch.cat([empty, *(d.inputs[key] for d in members)])

        ids = torch.cat([torch.zeros(0, dtype=torch.int64), *(d.tokens for d in members)])
        targets = column("target_tokens", torch.int64)
        values = {k: column(k, torch.float64) for k in batch.input_keys if k != "target_tokens"}
        datum_index = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(lens, dtype=torch.int64))
        local_ids = zigzag_slice(ids, plan).to(device)
        local_targets = zigzag_slice(targets, plan, pad_value=IGNORE_INDEX).to(device)
        local_inputs = {k: zigzag_slice(v, plan).to(device) for k, v in values.items()}
        local_datum = zigzag_slice(datum_index, plan, pad_value=-1).to(device)
        bad_loss: set[int] = set()
        bad_grad: set[int] = set()
        faults = fault_hooks(self.debug_fault, cp_size=self.cp_size, cp_rank=self.cp_rank, plan=plan)
        if self.debug_fault is not None:  # DEBUG-FAULT HOOK: the layers hand shard.faults to their ops
            shard = replace(shard, faults=faults)
        with torch.set_grad_enabled(backward):
            # A loss whose gradient in lp is known now (cross_entropy): the head makes its gradients in its forward.
            upstream = None
            saved = faults.unscored_grads(self.params, local_targets, local_inputs)  # DEBUG-FAULT HOOK (no-op)
            if backward:
                upstream = fixed_logprob_gradient(batch.loss, local_inputs, datum_index=local_datum, like=local_targets)
            lp = self.model(local_ids, shard, local_targets, upstream)
            elementwise = local_token_losses(
                batch.loss, lp, local_inputs, datum_index=local_datum, num_datums=len(row), group=self.cp_group
            )
            elementwise = faults.flip_loss_sign(elementwise)  # DEBUG-FAULT HOOK (parity negative control; no-op)
            if backward:
                loss = elementwise.sum().to(torch.float64) + self.invariant.loss_term()
                if self.router_aux_loss_coef:  # the row's load-balancing term (CP-invariant; collective over CP)
                    loss = loss + self.router_aux_loss_coef * router_stats.router_aux_loss(
                        moe_blocks(self.model), self.cp_group
                    )
                self.invariant.scale_loss(loss, batch.plan.microbatches_per_rank).backward()
                faults.skip_unscored_backward(self.params, saved)  # DEBUG-FAULT HOOK (parity negative control; no-op)
                if not flagged and not self._gradients_finite():
                    bad_grad.update(row)
        both = torch.stack([lp.detach(), elementwise.detach()], dim=-1).to(torch.float64)
        full = gather_row(both, plan, self.cp_group).cpu()
        out, start = {}, 0
        for i, n in zip(row, lens, strict=True):
            piece = full[start : start + n]
            out[i] = {"logprobs": piece[..., 0].clone(), "elementwise_loss": piece[..., 1].clone()}
            if not bool(torch.isfinite(piece).all()):
                bad_loss.add(i)
            start += n
        return out, bad_loss, bad_grad

    def _gradients_finite(self) -> bool:
        """Whether every gradient accumulated so far in this request is finite (one device sync; with FSDP one
        verdict per DeviceMesh, agreed over its ranks: the DP×CP shards, under EP also the expert replicas)."""
        by_mesh: dict[int, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
        verdicts = [bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) for grads in by_mesh.values()]
        return all(verdicts)

    def _collect(self, mine: dict, batch: Batch) -> ForwardBackwardResult:
        """Per-datum outputs of every DP group onto the result rank (one gather over the control group)."""
        parts = gather_object_to(mine, self.control_group, dst=0)
        if parts is None:
            return ForwardBackwardResult(outputs=None, metrics={})
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for part in parts:
            merged.update(part)
        outputs = [merged[i] for i in range(len(batch.datums))]
        loss = sum(float(o["elementwise_loss"].sum()) for o in outputs)
        metrics = {
            "loss:sum": loss,
            "num_tokens:sum": float(batch.num_tokens),
            "microbatches:sum": float(batch.plan.microbatches_per_rank * self.dp_size),
        }
        return ForwardBackwardResult(outputs=outputs, metrics=metrics)

    # ------------------------------------------------------------------ gradients, all-or-nothing

    def _repair(self) -> None:
        """After a rank failed between collectives: fresh data groups on every rank of the replica."""
        if self.mesh is None:
            return
        if self.fsdp_units:
            self.broken = SHARDED_GROUPS_LOST
            return
        try:
            rebuild_mesh(self.mesh)
            set_expert_parallel(self.model, self.mesh.ep_group)  # EP > 1: the blocks' rebuilt EP group
        except BaseException as exc:
            self.broken = f"rebuilding the data groups failed ({type(exc).__name__}: {exc})"
            raise

    # ------------------------------------------------------------------ optimizer

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Reduce the accumulated gradients (SUM over DP×CP, invariant-checked), clip, AdamW; collective.

        Raises UserInputError for bad ``adam`` (nothing changed), NonFiniteError when the summed gradient
        or a weight is not finite or the update would make a weight or AdamW moment non-finite on any rank
        (weights, moments and step unchanged; the accumulated gradients are dropped), RankFailedError when
        another rank failed.
        """
        self._check_usable()
        agreed_call(adam.validate, self.control_group)
        norm = math.nan
        error: BaseException | None = None
        bad_weights: list[str] = []
        bad_update: list[str] = []  # parameters whose AdamW update would not be finite (optimizer.non_finite_update)
        try:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.fsdp_units:  # FSDP summed the param grads in backward; the canary is still reduced and checked
                self.invariant.reduce_and_check([])
                sharding.reshard_all(self.fsdp_units)
                norm = sharding.sharded_grad_norm(self.params, sharding.shard_group(self.mesh, self.shard_params).group)
            else:
                if expert_parallel.ep_size(self.mesh) > 1:  # experts SUM over their replica group
                    self.invariant.reduce_and_check(*expert_parallel.split(self.params, self.names))
                else:
                    self.invariant.reduce_and_check([p.grad for p in self.params])
                if expert_parallel.ep_size(self.mesh) > 1:
                    norm = expert_parallel.grad_norm(self.params, self.names, self.mesh)
                else:
                    norm = global_grad_norm(self.params)
            bad_weights = [self.names[id(p)] for p in self.params if not bool(torch.isfinite(p.detach()).all())]
            if math.isfinite(norm) and not bad_weights:  # clipped here; dropped with the gradients if refused
                prepare_step(self.optimizer, self.params, adam, norm=norm)
                bad_update = [self.names[id(self.params[i])] for i in non_finite_update(self.optimizer, self.params)]
        except NOT_CAUGHT:
            raise
        except BaseException as exc:
            error = exc
        verdicts = all_gather_objects((math.isfinite(norm), bad_weights, bad_update), self.control_group)
        weights = sorted({n for _, names, _ in verdicts for n in names})
        updates = sorted({n for _, _, names in verdicts for n in names})
        if error is None and weights:
            error = NonFiniteError(
                f"optim_step refused: parameter(s) {', '.join(weights[:8])} hold non-finite values (the model is "
                "corrupt; load a checkpoint). Weights, AdamW moments and step unchanged; accumulated gradients dropped."
            )
        elif error is None and not all(finite for finite, _, _ in verdicts):
            error = NonFiniteError(
                f"optim_step refused: the summed gradient's norm is {norm} (not finite). Weights, AdamW moments "
                "and step unchanged; the accumulated gradients were dropped."
            )
        elif error is None and updates:
            error = NonFiniteError(
                f"optim_step refused: the AdamW update of parameter(s) {', '.join(updates[:8])} would make a weight "
                f"or moment non-finite (summed gradient norm {norm:.3g}: an element that large overflows the "
                "second moment; lower the learning rate or clip with grad_clip_norm). Weights, AdamW moments "
                "and step unchanged; the accumulated gradients were dropped."
            )
        try:
            agree(error, self.control_group)
        except BaseException:
            drop_gradients(self.params, self.invariant)
            raise
        self.faults.skip_weight_decay(self.optimizer)  # DEBUG-FAULT HOOK (no-op without)
        apply_step(self.optimizer)
        self.step += 1
        self.weights_version += 1
        replica_s = self.replicas.verify(self.params, self.names, self.optimizer, self.step, self.control_group)
        peak = torch.tensor([float(peak_memory_bytes())], dtype=torch.float64)
        peaks = all_gather_objects(float(peak), self.control_group)
        return {
            "grad_norm:mean": norm,
            "learning_rate:mean": float(adam.learning_rate),
            "peak_memory_gib:max": max(peaks) / 2**30,
            "step:max": float(self.step),
            "replica_check_ms:max": 1e3 * replica_s,
            "replica_tensors:max": float(self.replicas.compared),
        }

    # ------------------------------------------------------------------ state

    def save_state(self, path: str, *, extra: dict | None = None) -> None:
        """Weights + AdamW state + step, atomically (torch.distributed.checkpoint, manifest-checked on load);
        collective over the mesh's control group."""
        self._check_usable()
        sharding.reshard_all(self.fsdp_units)  # the registered parameters are the shards (the root may be unsharded)
        save_checkpoint(
            path, model=self.model, optimizer=self.optimizer, step=self.step, extra=extra, group=self.control_group
        )

    def load_state(self, path: str, *, optimizer: bool = True) -> dict:
        """Restore weights (and AdamW moments unless ``optimizer=False``: fresh moments); returns ``extra``.

        Raises UserInputError (nothing changed) when the checkpoint is missing or for another model.
        Accumulated gradients are dropped by a successful load.
        """
        self._check_usable()
        sharding.reshard_all(self.fsdp_units)  # loaded into the shards: the next forward all-gathers them
        step, extra = load_checkpoint(
            path, model=self.model, optimizer=self.optimizer if optimizer else None, group=self.control_group
        )
        if not optimizer:  # only after a successful load: a refused checkpoint changes nothing
            self.optimizer = new_adamw(self.params, self.adamw_kernel)
        self.invariant.reset()
        self.step = step
        self.weights_version += 1
        return extra

    def export_hf(self, path: str) -> None:
        """The current weights as an HF checkpoint directory (for sampling; in ``export_dtype`` when mixed);
        written by global rank 0."""
        self._check_usable()
        state = None
        if self.fsdp_units:  # gathered whole on every rank in turn, kept only by the writer (control rank 0)
            ep = expert_parallel.ep_size(self.mesh) > 1  # and the EP experts everywhere: gathered next over EP
            keep_also = is_expert_parameter if ep else None
            state = sharding.full_state_dict(self.model, keep=self.is_result_rank, keep_also=keep_also)
        if expert_parallel.ep_size(self.mesh) > 1:  # every expert, gathered over each EP group
            state = gather_expert_state(self.model, state)
        export_hf_weights(self.model, path, group=self.control_group, dtype=self.export_dtype, state=state)
