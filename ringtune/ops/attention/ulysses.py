"""All-to-all (Ulysses) context parallelism: switch from sequence shards to head shards and back.

An all-to-all over the CP group gives each rank the whole row for ``H/C`` query heads (and
``Hkv/C`` kv heads); it runs full causal varlen attention on them in the global padded order and
an all-to-all brings the output back to sequence shards. Needs both head counts divisible by C.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.errors import ParallelConfigError
from ringtune.layout.contiguous import rank_major_to_global
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.attention.blocks import varlen_block_attention
from ringtune.ops.attention.schedule import causal_pairs
from ringtune.parallel.relayout import heads_to_sequence, sequence_to_heads


def check_ulysses_heads(num_heads: int, num_kv_heads: int, cp_size: int) -> None:
    """Raise ParallelConfigError unless ``cp_size`` divides both head counts."""
    for name, value in (("attention heads", num_heads), ("kv heads", num_kv_heads)):
        if value % cp_size:
            raise ParallelConfigError(
                f"all-to-all attention needs {name} divisible by cp_size: {value} % {cp_size} != 0; "
                f"use the ring or all-gather mode"
            )


def ulysses_attention(
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
    """Causal varlen attention of one zigzag-sharded row by all-to-all over ``group``.

    Same contract as :func:`ringtune.ops.attention.ring.ring_attention`; raises ParallelConfigError
    when C does not divide the query or kv heads.
    """
    size = plan.cp_size
    check_ulysses_heads(q.shape[1], k.shape[1], size)
    to_global = rank_major_to_global(plan).to(q.device)
    to_rank_major = torch.argsort(to_global)
    qh, kh, vh = (sequence_to_heads(x, group, size).index_select(0, to_global) for x in (q, k, v))
    pairs = causal_pairs(plan.global_cu_seqlens[: len(plan.seq_lens) + 1])  # stream pads get no block
    out, lse = varlen_block_attention(qh, kh, vh, pairs, scale=scale, kernel=kernel)
    out = heads_to_sequence(out.index_select(0, to_rank_major), group, size)
    lse = heads_to_sequence(lse.index_select(0, to_rank_major).contiguous(), group, size, differentiable=False)
    return out, lse
