"""One packed row's forward (and backward) on this rank: :class:`MicrobatchRun`, built by
:meth:`~ringtune.engine.trainer.Trainer.run_batch` once per request from its pass target and its settings.

The row's inputs come from :func:`~ringtune.engine.microbatch_inputs.microbatch_inputs`; the loss (plus the
gradient invariant's canary and, for MoE, the load-balancing term) is backpropagated into the target's
``.grad``; the per-token log-probs and loss terms are gathered to full length over the CP group and split per
datum (:mod:`ringtune.engine.request_outcome`). Host syncs per microbatch: the gathered row's copy to the host
and, with backward, one read of the gradient's finite verdict (a fused reduction,
:meth:`~ringtune.engine.grad_sync.GradientSync.grads_finite`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from ringtune.debug_faults import fault_hooks
from ringtune.engine.batch import Batch
from ringtune.engine.grad_sync import GradientSync
from ringtune.engine.microbatch_inputs import microbatch_inputs
from ringtune.engine.pass_target import PassInvariant, PassTarget
from ringtune.engine.request_outcome import non_finite_datums, split_row
from ringtune.losses import fixed_logprob_gradient, local_token_losses
from ringtune.models.layers import moe_router_stats as router_stats
from ringtune.models.layers.moe import moe_blocks
from ringtune.parallel.row_gather import gather_row


@dataclass(frozen=True, kw_only=True)
class MicrobatchRun:
    """A pass's rows on this rank: the target (``model``, ``params``, ``invariant`` of a
    :class:`~ringtune.engine.pass_target.PassTarget`) and the trainer's settings (CP place and group, CP modes,
    padding, auxiliary-loss weight, debug fault, gradient sync for the finite check)."""

    model: nn.Module
    params: list[torch.nn.Parameter]
    invariant: PassInvariant
    cp_size: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    attention: str
    gated_delta: str
    pad_multiplier: int
    router_aux_loss_coef: float
    debug_fault: str | None
    grad_sync: GradientSync

    @classmethod
    def of(cls, target: PassTarget, **settings) -> MicrobatchRun:
        """``target``'s model, params and invariant with the trainer's ``settings`` (the other fields)."""
        return cls(model=target.model, params=target.params, invariant=target.invariant, **settings)

    def run(
        self, batch: Batch, row: tuple[int, ...], local_len: int, *, backward: bool, flagged: bool
    ) -> tuple[dict[int, dict[str, torch.Tensor]], set[int], set[int]]:
        """Run one packed row (collective over the CP group).

        Returns ({datum index: outputs} full length, on every CP rank; the datums of this row whose loss
        or log-probs are not finite; all of the row's datums if the gradient became non-finite here).
        ``flagged``: a previous microbatch already made the gradient non-finite (not checked again).
        """
        mb = microbatch_inputs(
            batch, row, local_len, self.model, cp_size=self.cp_size, cp_rank=self.cp_rank, cp_group=self.cp_group,
            attention=self.attention, gated_delta=self.gated_delta, pad_multiplier=self.pad_multiplier,
        )  # fmt: skip
        plan, shard, lens = mb.shard.plan, mb.shard, mb.lens
        local_ids, local_targets, local_inputs, local_datum = mb.ids, mb.targets, mb.inputs, mb.datum
        bad_grad: set[int] = set()
        faults = fault_hooks(self.debug_fault, cp_size=self.cp_size, cp_rank=self.cp_rank, plan=plan)
        if self.debug_fault is not None:  # DEBUG-FAULT HOOK: the layers hand shard.faults to their ops
            shard = replace(shard, faults=faults)
        with torch.set_grad_enabled(backward):
            # A loss whose gradient in lp is known now (cross_entropy): the head makes its gradients in its forward.
            upstream = None
            saved = faults.unscored_grads(self.params, local_targets, local_inputs)  # DEBUG-FAULT HOOK (no-op)
            adapter_saved = faults.adapter_grads(self.params, lora=hasattr(self.model, "adapters"))  # DEBUG-FAULT HOOK
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
                faults.double_adapter_grads(self.params, adapter_saved)  # DEBUG-FAULT HOOK (no-op)
                if not flagged and not bool(self.grad_sync.grads_finite(self.params)):
                    bad_grad.update(row)
        both = torch.stack([lp.detach(), elementwise.detach()], dim=-1).to(torch.float64)
        full = gather_row(both, plan, self.cp_group).cpu()
        return split_row(full, row, lens), non_finite_datums(full, row, lens), bad_grad
