"""All-gather K/V context parallelism (Llama-3 style).

Each rank all-gathers every rank's K/V shard over the CP group (rank-major), puts it in the global
padded stream order, and attends with its local zigzag queries against the keys before and at its
chunks. Same bytes as the ring, no overlap; simple and cheap when K/V are small (GQA). Backward is
autograd's: the block Function, the index permutation, then a reduce-scatter (SUM) of dK/dV.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.layout.contiguous import rank_major_to_global
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.attention.blocks import varlen_block_attention
from ringtune.ops.attention.schedule import global_key_pairs
from ringtune.parallel.collectives import all_gather


def allgather_attention(
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
    """Causal varlen attention of one zigzag-sharded row by all-gathering K/V over ``group``.

    Same contract as :func:`ringtune.ops.attention.ring.ring_attention` (``faults``: only
    ``allgather_kv_rank_reversed`` acts in this mode).
    """
    kv = all_gather(torch.stack([k, v], dim=1), group)  # [C·T_local, 2, Hkv, D], rank-major
    kv = faults.gathered_kv(kv, plan.cp_size)  # DEBUG-FAULT HOOK (parity negative control; no-op)
    kv = kv.index_select(0, rank_major_to_global(plan).to(kv.device))
    return varlen_block_attention(q, kv[:, 0], kv[:, 1], global_key_pairs(plan), scale=scale, kernel=kernel)
