"""The training engine: Tinker forward / forward_backward / optim_step over a DP×CP mesh.

Every rank of the mesh calls the same methods with the same request. The request is validated and packed
first (a user error changes nothing); then each DP rank runs its microbatches, each a packed row split
over the CP group by the zigzag layout. Per-datum outputs are gathered to full length (one CP all-reduce
per microbatch) and collected on the result rank (rank 0 of the DP×CP group). Gradients accumulate
locally over calls and are SUMMED over DP×CP at optim_step, checked by the gradient invariant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtune.engine import sharding
from ringtune.engine.checkpoint import export_hf_weights, load_checkpoint, save_checkpoint
from ringtune.engine.gather import gather_row
from ringtune.engine.gradients import GradientInvariant
from ringtune.engine.memory import peak_memory_bytes
from ringtune.engine.optimizer import AdamParams, adamw_step
from ringtune.engine.packing import PackingPlan, pack_datums
from ringtune.errors import ParallelConfigError, UserInputError
from ringtune.layout.zigzag import ZigzagPlan, zigzag_plan, zigzag_slice
from ringtune.losses import check_datum_inputs, local_token_losses, parse_loss_config
from ringtune.models.decoder import CausalLM
from ringtune.models.logprob_head import label_logprobs
from ringtune.models.shard import PackedShard
from ringtune.parallel.mesh import ParallelMesh

IGNORE = -100


@dataclass(frozen=True)
class TrainDatum:
    """One Tinker datum: ``tokens`` int64 [N] (the model input) and its ``loss_fn_inputs`` (leading dim N)."""

    tokens: torch.Tensor
    inputs: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardResult:
    """``outputs[i]`` = {"logprobs", "elementwise_loss"} of datum i (request order), full length; on the
    result rank only (None elsewhere). ``metrics`` likewise ({} elsewhere)."""

    outputs: list[dict[str, torch.Tensor]] | None
    metrics: dict[str, float]


class Trainer:
    """Owns the model replica of this rank, its AdamW state and the gradient invariant.

    Args:
        model: this rank's replica (identical on every rank of the DP×CP group).
        mesh: the DP×CP mesh, or None for a single process.
        max_tokens_per_rank: the per-rank token budget of a microbatch.
        attention, gated_delta: CP modes (checked against the model's heads here, at build time).
        pad_multiplier: the per-rank stream is padded to a multiple of this.
        fault: negative controls only (see :mod:`ringtune.engine.gradients`).
        shard_params: FSDP2 over DP, replicated over CP (:mod:`ringtune.engine.sharding`): parameters, gradients
            and AdamW state are DTensors sharded over the DP group, gradients are SUMMED by FSDP during
            backward (start-up probe checked); same numbers as the replicated engine.
    """

    def __init__(
        self,
        model: CausalLM,
        mesh: ParallelMesh | None,
        *,
        max_tokens_per_rank: int,
        attention: str = "ring",
        gated_delta: str = "headwise",
        pad_multiplier: int = 8,
        fault: str | None = None,
        shard_params: bool = False,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.dp_size, self.dp_rank = (mesh.dp_size, mesh.dp_rank) if mesh else (1, 0)
        self.cp_size, self.cp_rank = (mesh.cp_size, mesh.cp_rank) if mesh else (1, 0)
        self.cp_group = mesh.cp_group if mesh else None
        self.dp_cp_group = mesh.dp_cp_group if mesh else None
        self.max_tokens_per_rank = max_tokens_per_rank
        self.attention, self.gated_delta = attention, gated_delta
        self.pad_multiplier = pad_multiplier
        model.config.check_parallel(cp_size=self.cp_size, attention=attention, gated_delta=gated_delta)
        self.fsdp_units: list = []
        if shard_params:
            if mesh is None:
                raise ParallelConfigError("shard_params=True needs a mesh (it shards over the DP group); got None")
            modes = {"attention": attention, "gated_delta": gated_delta}
            self.fsdp_units = sharding.shard_params(model, mesh, **modes, fault=fault)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=0.0)
        self.invariant = GradientInvariant(self.dp_cp_group, fault=fault)
        self.invariant.startup_check()
        self.step = 0

    @property
    def is_result_rank(self) -> bool:
        """True on the one rank that returns results (rank 0 of the DP×CP group)."""
        return self.dp_cp_group is None or dist.get_rank(self.dp_cp_group) == 0

    # ------------------------------------------------------------------ request validation

    def _validate(self, data: Sequence[TrainDatum], loss_fn: str, loss_config: Mapping[str, float] | None):
        config = parse_loss_config(loss_fn, loss_config)
        vocab = self.model.config.vocab_size
        target_ndim = None
        for i, d in enumerate(data):
            tokens = d.tokens
            if tokens.ndim != 1 or tokens.dtype != torch.int64:
                raise UserInputError(
                    f"data[{i}].model_input: expected int64 [N] tokens, got {tokens.dtype} {tuple(tokens.shape)}"
                )
            if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
                raise UserInputError(
                    f"data[{i}].model_input: token ids must be in [0, {vocab}); got {int(tokens.max())}"
                )
            check_datum_inputs(loss_fn, i, tokens.numel(), d.inputs)
            targets = d.inputs["target_tokens"]
            if int(targets.min()) < 0 or int(targets.max()) >= vocab:
                raise UserInputError(f"data[{i}].loss_fn_inputs.target_tokens: ids must be in [0, {vocab})")
            if target_ndim is None:
                target_ndim = (targets.ndim, targets.shape[1:])
            elif (targets.ndim, targets.shape[1:]) != target_ndim:
                raise UserInputError(
                    f"data[{i}].loss_fn_inputs.target_tokens: shape {tuple(targets.shape)} differs from data[0]'s "
                    "trailing shape; one request holds [N] or [N, K] targets with one K"
                )
        plan = pack_datums(
            [d.tokens.numel() for d in data],
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            max_tokens_per_rank=self.max_tokens_per_rank,
            pad_multiplier=self.pad_multiplier,
        )
        return config, plan

    # ------------------------------------------------------------------ one microbatch

    def _row_plan(self, lens: list[int], local_len: int) -> ZigzagPlan:
        return zigzag_plan(
            lens, cp_size=self.cp_size, cp_rank=self.cp_rank, pad_multiplier=self.pad_multiplier, pad_to=local_len
        )

    def _microbatch(self, data, row: tuple[int, ...], local_len: int, config, *, backward: bool, count: int):
        """Run one packed row; returns {datum index: outputs} (full length, on every CP rank)."""
        lens = [data[i].tokens.numel() for i in row]
        plan = self._row_plan(lens, local_len)
        shard = PackedShard(
            plan=plan,
            positions=plan.positions,
            group=self.cp_group,
            attention=self.attention,
            gated_delta=self.gated_delta,
        )
        # Every microbatch carries the request's keys (a pad-only one as empty tensors of the same trailing
        # shapes), so every rank runs the same loss code and the same collectives.
        template = data[0].inputs
        members = [data[i] for i in row]
        ids = torch.cat([torch.zeros(0, dtype=torch.int64), *(d.tokens for d in members)])
        targets = torch.cat([template["target_tokens"][:0], *(d.inputs["target_tokens"] for d in members)])
        keys = [k for k in template if k != "target_tokens"]
        inputs_row = {k: torch.cat([template[k][:0], *(d.inputs[k] for d in members)]) for k in keys}
        datum_index = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(lens, dtype=torch.int64))
        local_ids = zigzag_slice(ids, plan)
        local_targets = zigzag_slice(targets, plan, pad_value=IGNORE)
        local_inputs = {k: zigzag_slice(v, plan) for k, v in inputs_row.items()}
        local_datum = zigzag_slice(datum_index, plan, pad_value=-1)
        with torch.set_grad_enabled(backward):
            hidden = self.model.hidden_states(local_ids, shard)
            weight = self.model.output_weight
            if local_targets.ndim == 2:
                lp = torch.stack(
                    [label_logprobs(hidden, weight, local_targets[:, j]) for j in range(local_targets.shape[1])], 1
                )
            else:
                lp = label_logprobs(hidden, weight, local_targets)
            elementwise = local_token_losses(
                config, lp, local_inputs, datum_index=local_datum, num_datums=len(row), group=self.cp_group
            )
            if backward:
                loss = elementwise.sum().to(torch.float64) + self.invariant.loss_term()
                self.invariant.scale_loss(loss, count).backward()
        both = torch.stack([lp.detach(), elementwise.detach()], dim=-1).to(torch.float64)
        full = gather_row(both, plan, self.cp_group)
        out, start = {}, 0
        for i, n in zip(row, lens, strict=True):
            piece = full[start : start + n]
            out[i] = {"logprobs": piece[..., 0].clone(), "elementwise_loss": piece[..., 1].clone()}
            start += n
        return out

    # ------------------------------------------------------------------ public API

    def forward_backward(
        self,
        data: Sequence[TrainDatum],
        loss_fn: str,
        loss_config: Mapping[str, float] | None = None,
        *,
        forward_only: bool = False,
    ) -> ForwardBackwardResult:
        """Tinker ``forward_backward`` (or ``forward`` with ``forward_only``); collective over the whole mesh.

        Gradients are added to this rank's local accumulators (reduced at :meth:`optim_step`).
        Raises UserInputError before any compute when the request is invalid.
        """
        config, plan = self._validate(data, loss_fn, loss_config)
        mine: dict[int, dict[str, torch.Tensor]] = {}
        count = plan.microbatches_per_rank
        for row, local_len in zip(plan.rows[self.dp_rank], plan.local_lens[self.dp_rank], strict=True):
            mine.update(self._microbatch(data, row, local_len, config, backward=not forward_only, count=count))
        if not forward_only:
            self.invariant.count(count)
        return self._collect(mine if self.cp_rank == 0 else {}, len(data), plan)

    def forward(self, data: Sequence[TrainDatum], loss_fn: str = "cross_entropy", loss_config=None):
        """Tinker ``forward``: outputs and loss, no gradients."""
        return self.forward_backward(data, loss_fn, loss_config, forward_only=True)

    def _collect(self, mine: dict, n: int, plan: PackingPlan) -> ForwardBackwardResult:
        """Per-datum outputs of every DP group onto the result rank (one gather_object over DP×CP)."""
        if self.dp_cp_group is not None and dist.get_world_size(self.dp_cp_group) > 1:
            parts = [None] * dist.get_world_size(self.dp_cp_group) if self.is_result_rank else None
            dist.gather_object(mine, parts, group=self.dp_cp_group, group_dst=0)
            if not self.is_result_rank:
                return ForwardBackwardResult(outputs=None, metrics={})
            for part in parts:
                mine.update(part)
        outputs = [mine[i] for i in range(n)]
        loss = sum(float(o["elementwise_loss"].sum()) for o in outputs)
        tokens = sum(int(o["logprobs"].shape[0]) for o in outputs)
        metrics = {
            "loss:sum": loss,
            "num_tokens:sum": float(tokens),
            "microbatches:sum": float(plan.microbatches_per_rank * self.dp_size),
        }
        return ForwardBackwardResult(outputs=outputs, metrics=metrics)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Reduce the accumulated gradients (SUM over DP×CP, invariant-checked), clip, AdamW; collective."""
        adam.validate()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.fsdp_units:  # FSDP summed the param grads in backward; the canary is still reduced and checked
            self.invariant.reduce_and_check([])
            sharding.reshard_all(self.fsdp_units)
            norm = sharding.sharded_grad_norm(self.params, self.mesh.dp_group)
            norm = adamw_step(self.optimizer, self.params, adam, norm=norm)
        else:
            self.invariant.reduce_and_check([p.grad for p in self.params])
            norm = adamw_step(self.optimizer, self.params, adam)
        self.step += 1
        peak = torch.tensor([float(peak_memory_bytes())], dtype=torch.float64)
        if self.dp_cp_group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.dp_cp_group)
        return {
            "grad_norm:mean": norm,
            "learning_rate:mean": adam.learning_rate,
            "peak_memory_gib:max": float(peak) / 2**30,
            "step:max": float(self.step),
        }

    # ------------------------------------------------------------------ state

    def save_state(self, path: str, *, extra: dict | None = None) -> None:
        """Weights + AdamW state + step, atomically (torch.distributed.checkpoint); collective over the world."""
        save_checkpoint(path, model=self.model, optimizer=self.optimizer, step=self.step, extra=extra)

    def load_state(self, path: str, *, optimizer: bool = True) -> dict:
        """Restore weights (and AdamW moments unless ``optimizer=False``: fresh moments); returns ``extra``.

        Raises UserInputError (nothing changed) when the checkpoint is missing or for another model.
        """
        step, extra = load_checkpoint(path, model=self.model, optimizer=self.optimizer if optimizer else None)
        if not optimizer:  # only after a successful load: a refused checkpoint changes nothing
            self.optimizer = torch.optim.AdamW(self.params, lr=0.0)
        self.step = step
        return extra

    def export_hf(self, path: str) -> None:
        """The current weights as an HF checkpoint directory (for sampling); written by global rank 0."""
        export_hf_weights(self.model, path)
