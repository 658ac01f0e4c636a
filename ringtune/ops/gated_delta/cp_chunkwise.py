"""Chunkwise context parallelism for GatedDeltaNet: state handed between contiguous parts.

1. Relayout zigzag -> contiguous (one all-to-all, a permutation): rank r owns ``[r·L, (r+1)·L)`` of
   the global padded stream (L = local_len), a split of the WHOLE stream.
2. Conv halo: the previous rank's last K-1 raw inputs (a ring shift), masked to the tokens of the
   sequence that crosses into this part; a part that starts a sequence gets zeros.
3. Each rank summarises the last segment of its part as an affine map of its incoming state,
   ``h_out = M·h_in + h_local`` (fp32, fp64 for fp64 inputs); the summaries are all-gathered and
   every rank folds those of the ranks before it in rank order to get its incoming state.
4. The core runs on the part with that state for its first segment (zeros for the others), and the
   output goes back to the zigzag layout by the inverse all-to-all.
Backward is autograd's mirror: the all-gather's reduce-scatter returns dM/dh_local to their owners,
the ring shift's reverse returns the halo gradient. Every rank must run these collectives in the same
order in backward too, so the graph chains them on every rank whatever its part looks like (halo ->
summary -> all-gather -> initial state -> core) with empty sums (``x[:0].sum()``, exactly 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.errors import ParallelConfigError
from ringtune.layout.contiguous import contiguous_part, global_segment_bounds, relayout_plan
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.gated_delta.conv import causal_conv1d
from ringtune.ops.gated_delta.core import gated_delta_core, pack_qkv, unpack_qkv
from ringtune.ops.gated_delta.summary import gated_delta_affine_summary
from ringtune.parallel.collectives import all_gather, ring_shift
from ringtune.parallel.relayout import contiguous_to_zigzag, zigzag_to_contiguous


def _halo_mask(plan: ZigzagPlan, kernel_minus_one: int) -> torch.Tensor:
    """bool [K-1]: which of the K-1 global positions before this part belong to the crossing sequence."""
    part = contiguous_part(plan)
    if not part.continues:
        return torch.zeros(kernel_minus_one, dtype=torch.bool, device="cpu")
    seg_start = max(b for b in global_segment_bounds(plan) if b <= part.start)
    positions = torch.arange(part.start - kernel_minus_one, part.start, device="cpu")
    return positions >= seg_start


def _last_segment_summary(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    context: torch.Tensor | None,
    g: torch.Tensor,
    beta: torch.Tensor,
    heads: tuple[int, int, int, int],
) -> torch.Tensor:
    """``[M | h_local]`` [Hv, Dk, Dk + Dv] of one segment of raw rows ``mixed`` (conv, L2 norm, affine scan)."""
    hk, dk, hv, dv = heads
    cu = torch.tensor([0, mixed.shape[0]], dtype=torch.int64, device="cpu")
    conv = causal_conv1d(mixed, conv_weight, cu, initial_context=context)
    _, kc, vc = unpack_qkv(conv, hk, dk, hv, dv)
    M, h_local = gated_delta_affine_summary(kc, vc, cu, g=g, beta=beta, use_qk_l2norm=True)
    return torch.cat([M[0], h_local[0]], dim=-1)


def _carries(plan: ZigzagPlan) -> bool:
    """True when this rank's part is one piece of a sequence that began on an earlier rank."""
    part = contiguous_part(plan)
    return part.continues and part.cu_seqlens.numel() == 2


def chunkwise_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    plan: ZigzagPlan,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    faults: FaultHooks = NO_FAULTS,
) -> torch.Tensor:
    """GDN core of one zigzag-sharded row by contiguous parts and a state hand-off over ``group``.

    Same contract as :func:`~ringtune.ops.gated_delta.cp_headwise.headwise_gated_delta`, any head
    counts. Requires ``local_len >= K-1`` at CP > 1. ``faults``: debug-fault hooks (:mod:`ringtune.debug_faults`:
    ``gdn_state_dropped``, ``gdn_halo_dropped``, ``gdn_decay_relayout_bf16`` act here; the default injects nothing).
    """
    size, rank = plan.cp_size, plan.cp_rank
    T, hk, dk = k.shape
    hv, dv = v.shape[1:]
    halo = conv_weight.shape[1] - 1
    if size > 1 and plan.local_len < halo:
        raise ParallelConfigError(
            f"chunkwise GatedDeltaNet CP needs local_len >= conv kernel - 1: {plan.local_len} < {halo}"
        )
    moves = relayout_plan(plan)
    # Two relayouts: q/k/v/beta in the input dtype, the log decay g in its own (float32 for bf16 inputs).
    packed = torch.cat([pack_qkv(q, k, v), beta], dim=1)
    mixed, bc = zigzag_to_contiguous(packed, moves, group).split([packed.shape[1] - hv, hv], dim=1)
    g = faults.decay_relayout(g, q.dtype)  # DEBUG-FAULT HOOK (parity negative control; no-op)
    gc = zigzag_to_contiguous(g, moves, group)
    part = contiguous_part(plan)
    cu = part.cu_seqlens
    n_seg = cu.numel() - 1

    context = None
    if size > 1 and halo > 0:
        tail = ring_shift(mixed[T - halo :], group, 1)  # the previous rank's last K-1 raw rows
        mask = faults.halo_mask(_halo_mask(plan, halo).to(mixed.device))  # DEBUG-FAULT HOOK (no-op)
        first = torch.where(mask.unsqueeze(1), tail, torch.zeros_like(tail))
        context = torch.cat([first.unsqueeze(0), mixed.new_zeros(max(n_seg - 1, 0), halo, mixed.shape[1])])

    initial_state = None
    if size > 1:
        # Summary of this part's last segment (rank C-1 has no successor and sends zeros).
        lo, hi = int(cu[-2]), int(cu[-1])
        if rank < size - 1 and hi > lo:
            seg = slice(lo, hi)
            seg_ctx = context[-1:] if context is not None else None
            # Recomputed in backward (activation checkpoint, local ops only): the scan carries Dk + Dv
            # wide values, and keeping its activations would cost ~1.5x the core's on ranks 0..C-2.
            summary = checkpoint(
                _last_segment_summary,
                mixed[seg],
                conv_weight,
                seg_ctx,
                gc[seg],
                bc[seg],
                (hk, dk, hv, dv),
                use_reentrant=False,
            )
        else:
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            # In the graph (an empty sum) so this rank still joins the all-gather's backward.
            summary = torch.zeros(hv, dk, dk + dv, dtype=acc, device=q.device) + mixed[:0].sum()
        if context is not None:
            summary = summary + context[:, :0].sum()  # the halo exchange comes first, on every rank
        gathered = all_gather(summary, group).reshape(size, hv, dk, dk + dv)
        # Anchored to the gathered summaries even where no summary is used (rank 0): every rank must
        # run the all-gather's backward reduce-scatter, or the others hang in it.
        h_in = torch.zeros(hv, dk, dv, dtype=gathered.dtype, device=q.device) + gathered[:0].sum()
        summaries = gathered.unbind(0)  # one view per rank; its backward is one stack (not C zero-filled copies)
        for j in range(rank):
            M_j, h_j = summaries[j][..., :dk], summaries[j][..., dk:]
            h_out = (M_j @ h_in if _carries(plan.for_rank(j)) else 0) + h_j
            h_in = h_out if contiguous_part(plan.for_rank(j + 1)).continues else torch.zeros_like(h_in)
        h_in = faults.handed_state(h_in)  # DEBUG-FAULT HOOK (parity negative control; no-op)
        if n_seg > 0:  # built on every rank, so the all-gather's backward runs on every rank
            first_state = h_in if part.continues else h_in * 0
            initial_state = torch.cat([first_state.unsqueeze(0), h_in.new_zeros(n_seg - 1, hv, dk, dv)])

    qc, kc, vc = unpack_qkv(mixed, hk, dk, hv, dv)
    o = gated_delta_core(
        qc,
        kc,
        vc,
        cu,
        g=gc,
        beta=bc,
        conv_weight=conv_weight,
        scale=scale,
        conv_context=context,
        initial_state=initial_state,
    )
    if size > 1:
        # The output depends on the all-gather (and, through it, the halo) on every rank, even where the
        # part holds no segment or a fault drops the state: every rank then runs the same backward
        # collectives in the same order (reduce-scatter, then the reverse ring shift).
        o = o + gathered.flatten()[:0].sum()
    return contiguous_to_zigzag(o.reshape(T, hv * dv), moves, group).reshape(T, hv, dv)
