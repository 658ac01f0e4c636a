"""Which attention blocks each CP variant computes: pure index math over a ZigzagPlan.

A :class:`BlockPair` names a query segment and a key segment of the same sequence and whether the
block is ``causal`` (equal lengths, query i sees keys 0..i) or full. The zigzag map makes every
block of the ring one of three kinds (diagonal, full, skipped), and every rank does the same work.
Stream pads get no block: their output is 0 and their log-sum-exp -inf.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ringtune.layout.zigzag import ZigzagPlan


@dataclass(frozen=True)
class BlockPair:
    """Queries ``[q_start, q_end)`` attend to keys ``[k_start, k_end)`` (indices into the q and kv buffers)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool

    @property
    def work(self) -> int:
        """Query-key scores this block needs (the causal triangle counts its diagonal)."""
        nq, nk = self.q_end - self.q_start, self.k_end - self.k_start
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def causal_pairs(cu_seqlens: torch.Tensor | list[int]) -> list[BlockPair]:
    """One causal block per non-empty segment of ``cu_seqlens`` (self-attention within each sequence)."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return [BlockPair(s, e, s, e, True) for s, e in itertools.pairwise(bounds) if e > s]


def ring_step_pairs(plan: ZigzagPlan, src_rank: int) -> list[BlockPair]:
    """Blocks rank ``plan.cp_rank`` computes against the K/V of rank ``src_rank`` (local coordinates of both).

    Per sequence with local part ``[s, s+2c)`` (chunks r and 2C-1-r):
    - src == r: causal over the whole local part (chunk r diagonal, chunk 2C-1-r sees chunk r fully);
    - src < r: every local query against src's first chunk (full); src's second chunk is in the future;
    - src > r: only this rank's second chunk against both of src's chunks (full); the first chunk
      precedes both of them.
    """
    r = plan.cp_rank
    pairs = []
    for s, c in zip(plan.local_starts, plan.chunk_lens, strict=True):
        if src_rank == r:
            pairs.append(BlockPair(s, s + 2 * c, s, s + 2 * c, True))
        elif src_rank < r:
            pairs.append(BlockPair(s, s + 2 * c, s, s + c, False))
        else:
            pairs.append(BlockPair(s + c, s + 2 * c, s, s + 2 * c, False))
    return pairs


def global_key_pairs(plan: ZigzagPlan) -> list[BlockPair]:
    """Blocks of this rank's local queries against K/V laid out in the global padded stream order.

    For the chunk at global offset ``a·c`` of a sequence starting at ``g``: a full block against
    ``[g, g+a·c)`` (when non-empty) and a causal block against ``[g+a·c, g+(a+1)·c)``.
    """
    pairs = []
    for s, g, c, ranges in zip(plan.local_starts, plan.global_starts, plan.chunk_lens, plan.chunk_ranges, strict=True):
        for offset, (start, end) in zip((s, s + c), ranges, strict=True):
            if start > 0:
                pairs.append(BlockPair(offset, offset + c, g, g + start, False))
            pairs.append(BlockPair(offset, offset + c, g + start, g + end, True))
    return pairs


def ring_work(plan: ZigzagPlan) -> int:
    """Total query-key scores rank ``plan.cp_rank`` computes over all ring steps."""
    return sum(p.work for src in range(plan.cp_size) for p in ring_step_pairs(plan, src))


def contiguous_split_work(seq_lens: list[int] | tuple[int, ...], cp_size: int) -> list[int]:
    """Causal query-key scores per rank if the unpadded packed row were split in C contiguous parts.

    The comparison point for load balance: rank r owns tokens ``[r·n/C, (r+1)·n/C)`` of the row, and a
    query at position p of its sequence needs p+1 scores.
    """
    total = sum(seq_lens)
    pos = (
        torch.cat([torch.arange(n, dtype=torch.int64, device="cpu") for n in seq_lens])
        if seq_lens
        else torch.zeros(0, device="cpu")
    )
    bounds = [total * r // cp_size for r in range(cp_size + 1)]
    return [int((pos[bounds[r] : bounds[r + 1]] + 1).sum()) for r in range(cp_size)]
