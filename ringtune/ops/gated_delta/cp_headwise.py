"""Headwise context parallelism for GatedDeltaNet: switch from sequence shards to head shards.

One all-to-all over the CP group gives each rank the whole row (in the global padded order) for
``Hk/C`` key heads and ``Hv/C`` value heads; it runs the single-device core
(:func:`~ringtune.ops.gated_delta.core.gated_delta_core`) with its rows of the conv weight, and an
all-to-all brings the output back to zigzag shards. Needs TP·C to divide both linear head counts.
Segments: every padded sequence, and every rank's stream pad block on its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.errors import ParallelConfigError
from ringtune.layout.contiguous import global_segment_bounds, rank_major_to_global
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.gated_delta.core import gated_delta_core
from ringtune.parallel.collectives import all_to_all
from ringtune.parallel.relayout import heads_to_sequence


def check_headwise_heads(num_k_heads: int, num_v_heads: int, cp_size: int, tp_size: int = 1) -> None:
    """Raise ParallelConfigError unless ``tp_size·cp_size`` divides both linear head counts."""
    split = tp_size * cp_size
    for name, value in (("linear key heads", num_k_heads), ("linear value heads", num_v_heads)):
        if value % split:
            raise ParallelConfigError(
                f"headwise GatedDeltaNet CP needs {name} divisible by TP·CP: {value} % ({tp_size}·{cp_size}) != 0; "
                f"use linear_cp_mode='chunkwise' or another CP size"
            )


def _conv_rows(conv_weight: torch.Tensor, rank: int, size: int, hk: int, dk: int, hv: int, dv: int):
    """The rows of the conv weight that belong to ``rank``'s heads, in core channel order."""
    qk_rows, v_rows = hk * dk // size, hv * dv // size
    q = conv_weight[rank * qk_rows : (rank + 1) * qk_rows]
    k = conv_weight[hk * dk + rank * qk_rows : hk * dk + (rank + 1) * qk_rows]
    v = conv_weight[2 * hk * dk + rank * v_rows : 2 * hk * dk + (rank + 1) * v_rows]
    return torch.cat([q, k, v])


def headwise_gated_delta(
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
    """GDN core of one zigzag-sharded row by head shards over ``group`` (the CP group).

    Args:
        q, k: [T_local, Hk, Dk]; v: [T_local, Hv, Dv] raw projections; g, beta: [T_local, Hv]; this
            rank's zigzag shard. conv_weight: [2·Hk·Dk + Hv·Dv, K], replicated.
    Returns:
        o [T_local, Hv, Dv], zigzag shard. Differentiable; every rank of ``group`` must call it.
        The conv weight's gradient on one rank covers its heads only: the SUM over the CP group is
        the full gradient (the replicated-parameter rule).
    ``faults``: the shared signature's debug-fault hooks; no fault acts in this mode.
    """
    size, rank = plan.cp_size, plan.cp_rank
    T, hk, dk = k.shape
    hv, dv = v.shape[1:]
    check_headwise_heads(hk, hv, size, plan.tp_size)
    order = rank_major_to_global(plan).to(q.device)

    def to_heads(parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        # [T, C, F]: the head groups of each rank side by side; all-to-all delivers rank-major rows of my heads.
        widths = [x.shape[1] * x.shape[2] // size for x in parts]
        blocks = torch.cat([x.reshape(T, size, w) for x, w in zip(parts, widths, strict=True)], dim=2)
        moved = all_to_all(blocks.transpose(0, 1).reshape(size * T, sum(widths)), group)
        return list(moved.index_select(0, order).split(widths, dim=1))

    # Two all-to-alls: q/k/v/beta in the input dtype, the log decay g in its own (float32 for bf16
    # inputs), so neither is rounded nor promoted.
    qh, kh, vh, bh = to_heads((q, k, v, beta.unsqueeze(-1)))
    (gh,) = to_heads((g.unsqueeze(-1),))
    n = size * T
    o = gated_delta_core(
        qh.reshape(n, hk // size, dk),
        kh.reshape(n, hk // size, dk),
        vh.reshape(n, hv // size, dv),
        torch.tensor(global_segment_bounds(plan), dtype=torch.int64, device="cpu"),
        g=gh,
        beta=bh,
        conv_weight=_conv_rows(conv_weight, rank, size, hk, dk, hv, dv),
        scale=scale,
    )
    o = o.index_select(0, torch.argsort(rank_major_to_global(plan)).to(o.device))
    return heads_to_sequence(o, group, size)
