"""The training engine: Tinker forward / forward_backward / optim_step over a DP×CP mesh, all-or-nothing.

Every rank of the mesh calls the same methods with the same request. A request is first turned into a
validated :class:`~ringtune.engine.batch.Batch` (a pure function: a user error is raised on every rank
alike, before any compute). Then each DP rank runs its microbatches, each a packed row split over the CP
group by the zigzag layout. Per-datum outputs are gathered to full length (one CP all-reduce per
microbatch) and collected on the result rank (rank 0 of the DP×CP group). Gradients accumulate locally
over calls and are SUMMED over DP×CP at optim_step (or, replicated, during the backward of a step's only
request, :mod:`ringtune.engine.grad_overlap`), checked by the gradient invariant.

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
  moment; each rank bounds its update from the maxima of weights, gradients and moments, and runs the exact
  update on copies only where the bound fails, :mod:`ringtune.engine.update_guard`): weights, moments and step
  untouched on every rank; the accumulated gradients are dropped.

The parts: the optimizer step's sequence (:mod:`ringtune.engine.optim_step`), the gradient SUM, norm and finite
check per parameter layout (:mod:`ringtune.engine.grad_sync`), one row's run (:mod:`ringtune.engine.microbatch`)
and its inputs (:mod:`ringtune.engine.microbatch_inputs`), what a pass runs on (:mod:`ringtune.engine.pass_target`),
the agreements (:mod:`ringtune.engine.request_guard`), the step's finite guard (:mod:`ringtune.engine.update_guard`).
A step reads values back to the host O(1) times: once per microbatch (the gathered outputs and the gradient's
finite verdict) and a few times per optimizer step (benchmarks/lean_step.py counts them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtune.debug_faults import check_fault, fault_hooks
from ringtune.engine import expert_parallel, sharding
from ringtune.engine.batch import MAX_TARGET_K, Batch, TrainDatum, build_batch
from ringtune.engine.checkpoint import export_hf_weights, load_checkpoint, save_checkpoint
from ringtune.engine.grad_stash import GradientStash
from ringtune.engine.grad_sync import gradient_sync_for
from ringtune.engine.gradients import GradientInvariant
from ringtune.engine.microbatch import MicrobatchRun
from ringtune.engine.optim_step import run_optim_step
from ringtune.engine.optimizer import AdamParams, new_adamw
from ringtune.engine.pass_target import PassTarget
from ringtune.engine.replica_check import ReplicaCheck
from ringtune.engine.request_guard import settle_request
from ringtune.engine.request_outcome import ForwardBackwardResult, collect_outputs
from ringtune.engine.state_bounds import StateBounds
from ringtune.errors import ParallelConfigError
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
from ringtune.models.precision import check_compute_dtype, export_dtype, set_compute_dtype
from ringtune.models.recompute import DEFAULT_RECOMPUTE, check_recompute_mode, set_recompute
from ringtune.ops.cp_modes import DEFAULT_ATTENTION, DEFAULT_GATED_DELTA
from ringtune.parallel.control import NOT_CAUGHT, RankFailedError, agreed_call, gather_object_to
from ringtune.parallel.mesh import ParallelMesh, rebuild_mesh

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
            CPU and CUDA (:func:`ringtune.engine.optimizer.default_adamw_kernel`).
        freeze_vision: full fine-tuning of a VL model leaves its vision tower as loaded (no gradients, no
            AdamW state); False (default) trains it. LoRA runs never adapt the tower (their base is frozen).

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
        freeze_vision: bool = False,
    ) -> None:
        if freeze_vision and getattr(model.model, "visual", None) is not None:  # before the trainable set is taken
            model.model.visual.requires_grad_(False)
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
        device = model.model.embed_tokens.weight.device  # every parameter's (one device authority: mesh.device)
        # The one debug-fault hooks object of this trainer (:mod:`ringtune.debug_faults`; NO_FAULTS in normal use).
        self.faults = fault_hooks(check_fault(debug_fault or fault), cp_size=self.cp_size, cp_rank=self.cp_rank)
        self.invariant = GradientInvariant(
            lambda: self.dp_cp_group, faults=self.faults, expert_group=expert_group, device=device
        )
        self.invariant.startup_check()
        self.grad_sync = gradient_sync_for(
            invariant=self.invariant, mesh=mesh, shard_params=self.shard_params, fsdp_units=self.fsdp_units,
            names=self.names,
        )  # fmt: skip
        self.replicas = ReplicaCheck(mesh, self.shard_params, model)  # replicas compared after every optim_step
        self.state_bounds = StateBounds()  # max |weight|, |moment| bounds carried between steps (update_guard.py)
        self.step = 0
        self.weights_version = 0  # bumped whenever the weights change (a sampler snapshot of them is then stale)
        self.broken: str | None = None

    @property
    def target(self) -> PassTarget:
        """This trainer's own pass target: its model, its trainable parameters and its gradient invariant."""
        return PassTarget(model=self.model, params=self.params, invariant=self.invariant)

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
            vision=self.model.config.vision,
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

    def run_batch(
        self, batch: Batch, *, forward_only: bool = False, target: PassTarget | None = None
    ) -> ForwardBackwardResult:
        """Run a validated :class:`Batch` (identical on every rank) all-or-nothing; see :meth:`forward_backward`.

        ``target``: what the pass runs on and accumulates into (:mod:`ringtune.engine.pass_target`; None: this
        trainer's own, :attr:`target`); the mesh, modes and options are this trainer's either way.
        """
        self._check_usable()
        on = self.target if target is None else target
        stash = None if forward_only else GradientStash.take(on.params, on.invariant)
        if stash is not None and target is None:
            self.grad_sync.drop_overlap()  # the gradients will change: an earlier request's reduction is stale
        # The step's only request so far: its gradients are reduced while its last backward runs (grad_overlap.py).
        overlap = stash is not None and target is None and stash.holds_nothing()
        mine: dict[int, dict[str, torch.Tensor]] = {}
        loss_bad: set[int] = set()  # datums whose loss or log-probs are not finite
        grad_bad: set[int] = set()  # datums of the microbatch after which the gradient became non-finite
        error: BaseException | None = None
        count = batch.plan.microbatches_per_rank
        loads: dict[str, torch.Tensor] = {}  # per MoE layer: expert assignments of this rank's real tokens
        rows = list(zip(batch.plan.rows[self.dp_rank], batch.plan.local_lens[self.dp_rank], strict=True))
        run = MicrobatchRun.of(
            on, cp_size=self.cp_size, cp_rank=self.cp_rank, cp_group=self.cp_group, attention=self.attention,
            gated_delta=self.gated_delta, pad_multiplier=self.pad_multiplier, debug_fault=self.debug_fault,
            router_aux_loss_coef=self.router_aux_loss_coef, grad_sync=self.grad_sync,
        )  # fmt: skip
        try:
            for m, (row, local_len) in enumerate(rows):
                self.faults.microbatch_started(m)  # DEBUG-FAULT HOOK (failure injection in tests; no-op)
                if overlap and m == len(rows) - 1:
                    self.grad_sync.start_overlap(on.params)
                out, bad_loss, bad_grad = run.run(
                    batch, row, local_len, backward=not forward_only, flagged=bool(grad_bad)
                )
                mine.update(out)
                loads = router_stats.add_counts(loads, router_stats.layer_counts(named_moe_blocks(on.model)))
                loss_bad |= bad_loss
                grad_bad |= bad_grad
        except NOT_CAUGHT:
            self.grad_sync.drop_overlap()
            raise
        except BaseException as exc:
            error = exc
        generation = self.mesh.generation if self.mesh else 0
        try:
            settle_request(
                error, loss_bad, grad_bad, batch=batch, forward_only=forward_only, stash=stash,
                group=self.control_group, repair=self._repair, mark_broken=self._mark_broken,
            )  # fmt: skip
        except BaseException:
            if overlap:  # refused: launch and wait what is pending unless the data groups were rebuilt; drop it
                repaired = self.mesh is not None and self.mesh.generation != generation
                self.broken = self.broken or self.grad_sync.abandon_overlap(in_step=not (self.broken or repaired))
            raise
        if overlap:  # every rank succeeded, so every rank launched the same buckets: wait for them
            self.grad_sync.finish_overlap()
        if stash is not None:
            stash.merge()
            on.invariant.count(count)
        result = collect_outputs(mine if self.cp_rank == 0 else {}, batch, self.dp_size, self.control_group)
        if moe_blocks(on.model):  # expert load over the whole request (every rank's tokens)
            parts = gather_object_to(loads, self.control_group, dst=0)
            if parts is not None:
                result.metrics.update(router_stats.load_metrics(parts))
        return result

    def _mark_broken(self, why: str) -> None:
        self.broken = why

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
        another rank failed. The gradient norm, the finite checks and the update guard are read back in one
        host sync (:func:`~ringtune.engine.update_guard.read_step_figures`); the sequence is
        :mod:`ringtune.engine.optim_step`'s.
        """
        self._check_usable()
        return run_optim_step(self, adam)

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
        self.state_bounds.forget()  # loaded in place: the version counters tell, but a load is not an update
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
