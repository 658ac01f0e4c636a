"""Zigzag ring attention: K/V rotate around the CP group, blocks merge by log-sum-exp.

Forward, at step i rank r holds the K/V of rank ``src = (r - i) mod C``; it posts the asynchronous
send of that K/V to r+1 (and the receive from r-1) before computing its blocks against it, so the
transfer overlaps the compute. Backward rotates K/V the same way and sends the partial dK/dV of the
K/V it just used along with it: the dK/dV of rank src starts at rank src+1 at step 1, collects a
contribution on every rank and reaches src after step C-1, where the local step-0 part is added.
K/V travel C-1 hops each way; dK/dV C-1 hops (in the accumulator dtype).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.attention.blocks import (
    accumulator_dtype,
    backward_blocks,
    block_grads,
    default_scale,
    forward_blocks,
    from_heads_major,
    new_accumulators,
    stack_heads_major,
    to_heads_major,
)
from ringtune.ops.attention.kernels import BlockKernel, select_block_kernel
from ringtune.ops.attention.schedule import BlockPair, ring_step_pairs
from ringtune.parallel.collectives import RingExchange

KV_TAG, DKV_TAG = 0, 1


def ring_forward(
    q_h: torch.Tensor,
    kv: torch.Tensor,
    plan: ZigzagPlan,
    group: dist.ProcessGroup,
    *,
    scale: float,
    kernel: BlockKernel,
    faults: FaultHooks = NO_FAULTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain forward: ``q_h`` [1, Hq, T, D], ``kv`` = stack(k_h, v_h) [2, 1, Hkv, T, D], zigzag shards.

    Returns the merged ``(out, lse)`` accumulators [1, Hq, T, D], [1, Hq, T]. Talks over ``group``.
    ``faults``: debug-fault hooks (:mod:`ringtune.debug_faults`; the default injects nothing).
    """
    size = plan.cp_size
    ring = RingExchange(group) if size > 1 else None
    out, lse = new_accumulators(q_h)
    for step in range(size):
        pending = ring.start(kv, tag=KV_TAG) if ring is not None and step < size - 1 else None
        src = faults.ring_source(plan.cp_rank, step, size)  # DEBUG-FAULT HOOK: (r - step) mod C
        pairs = ring_step_pairs(plan, src)  # step 0: one block per sequence, each row covered once
        forward_blocks(q_h, kv[0], kv[1], pairs, out, lse, scale=scale, kernel=kernel, fresh=step == 0)
        if pending is not None:
            kv = RingExchange.finish(pending)
    return out, lse


def _add_key_grads(dkv: torch.Tensor, grads: list[tuple[BlockPair, torch.Tensor, torch.Tensor]]) -> None:
    """In place: add each block's dk/dv (from :func:`block_grads`) into ``dkv`` [2, 1, Hkv, T, D] at its keys."""
    for p, bdk, bdv in grads:
        dkv[0][:, :, p.k_start : p.k_end] += bdk
        dkv[1][:, :, p.k_start : p.k_end] += bdv


def ring_backward(
    dout_h: torch.Tensor,
    q_h: torch.Tensor,
    kv: torch.Tensor,
    out_h: torch.Tensor,
    lse: torch.Tensor,
    plan: ZigzagPlan,
    group: dist.ProcessGroup,
    *,
    scale: float,
    kernel: BlockKernel,
    faults: FaultHooks = NO_FAULTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain backward: returns ``dq`` [1, Hq, T, D] and ``dkv`` [2, 1, Hkv, T, D] in the accumulator dtype."""
    size = plan.cp_size
    acc = accumulator_dtype(q_h.dtype)
    dq = torch.zeros(q_h.shape, dtype=acc, device=q_h.device)
    own_dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    ring = RingExchange(group) if size > 1 else None
    pending_dkv = None  # the dK/dV this rank passed on last step, being received by the next rank
    for step in range(size):
        pending_kv = ring.start(kv, tag=KV_TAG) if ring is not None and step < size - 1 else None
        src = faults.ring_source(plan.cp_rank, step, size)  # DEBUG-FAULT HOOK: (r - step) mod C
        pairs = ring_step_pairs(plan, src)
        if step == 0:
            backward_blocks(
                dout_h, q_h, kv[0], kv[1], out_h, lse, pairs, dq, own_dkv[0], own_dkv[1], scale=scale, kernel=kernel
            )
        else:
            # This step's blocks first (the incoming dK/dV travels meanwhile); they are added straight into
            # the partial dK/dV of src that rank r-1 sends, so no zeroed dK/dV buffer is held (step 1 starts one).
            grads = list(block_grads(dout_h, q_h, kv[0], kv[1], out_h, lse, pairs, dq, scale=scale, kernel=kernel))
            dkv = RingExchange.finish(pending_dkv) if pending_dkv is not None else torch.zeros_like(own_dkv)
            _add_key_grads(dkv, grads)
            del grads
            dkv = faults.dkv_exchange(dkv, q_h.dtype)  # DEBUG-FAULT HOOK (parity negative control; no-op)
            assert ring is not None  # step >= 1 only happens at size > 1
            pending_dkv = ring.start(dkv, tag=DKV_TAG)
        if pending_kv is not None:
            kv = RingExchange.finish(pending_kv)
    if pending_dkv is not None:
        own_dkv += RingExchange.finish(pending_dkv)
    return dq, own_dkv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale, kernel, faults):
        q_h = to_heads_major(q)
        kv = stack_heads_major(k, v)
        out, lse = ring_forward(q_h, kv, plan, group, scale=scale, kernel=kernel, faults=faults)
        out_h = out.to(q.dtype)
        ctx.save_for_backward(q_h, kv, out_h, lse)
        ctx.plan, ctx.group, ctx.scale, ctx.kernel, ctx.faults = plan, group, scale, kernel, faults
        lse_t = from_heads_major(lse)
        ctx.mark_non_differentiable(lse_t)
        return from_heads_major(out_h), lse_t

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_h, kv, out_h, lse = ctx.saved_tensors
        dq, dkv = ring_backward(
            *(to_heads_major(dout), q_h, kv, out_h, lse, ctx.plan, ctx.group),
            scale=ctx.scale,
            kernel=ctx.kernel,
            faults=ctx.faults,
        )
        dtype = q_h.dtype
        return (
            from_heads_major(dq).to(dtype),
            from_heads_major(dkv[0]).to(dtype),
            from_heads_major(dkv[1]).to(dtype),
            None,
            None,
            None,
            None,
            None,
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ZigzagPlan,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    kernel: str | None = None,
    faults: FaultHooks = NO_FAULTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention of one zigzag-sharded packed row by the zigzag ring over ``group`` (the CP group).

    Args:
        q: [T_local, Hq, D]; k, v: [T_local, Hkv, D], this rank's zigzag shard (``plan.local_len`` tokens).
        plan: this rank's :class:`ZigzagPlan` of the row (same row on every rank of ``group``).
        faults: debug-fault hooks (:mod:`ringtune.debug_faults`; the default injects nothing).
    Returns:
        ``(out [T_local, Hq, D], lse [T_local, Hq])``; stream-pad rows get out 0 and lse -inf.
        Differentiable in q, k, v; every rank of ``group`` must call it (forward and backward).
    """
    chosen = select_block_kernel(q.device, q.dtype, kernel)
    return _RingAttention.apply(q, k, v, plan, group, default_scale(q, scale), chosen, faults)
