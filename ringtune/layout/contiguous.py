"""The contiguous split of the global padded stream, and the permutation zigzag <-> contiguous.

Pure index math. The global padded stream (see :mod:`ringtune.layout.zigzag`) has ``C·local_len``
tokens; in the contiguous layout rank ``r`` owns ``[r·local_len, (r+1)·local_len)`` of it: a split
of the WHOLE packed stream, not of each sequence. Chunkwise GatedDeltaNet runs in this layout:
sequences that cross a split carry state from the previous rank, sequences that start inside a
part start from zero.

Going between the layouts is a permutation: every rank sends each of its tokens to exactly one
rank (an all-to-all with uneven counts), never an all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringtune.layout.zigzag import ZigzagPlan


@dataclass(frozen=True, kw_only=True)
class ContiguousPart:
    """Rank ``cp_rank``'s contiguous part of the global padded stream.

    Attributes:
        start, end: the part ``[start, end)`` in global padded coordinates.
        cu_seqlens: int64 segment boundaries inside the part (local coordinates, first 0, last end-start);
            segments are the pieces of sequences (and of stream pads) that fall in the part.
        continues: True when the first segment began on an earlier rank (it carries incoming state).
    """

    start: int
    end: int
    cu_seqlens: torch.Tensor
    continues: bool


def global_segment_bounds(plan: ZigzagPlan) -> list[int]:
    """Segment boundaries of the global padded stream: 0, each padded sequence, then each rank's stream pad.

    Every padded sequence (``2C·c_i`` tokens) is one segment and so is each rank's stream pad block
    (``stream_pad_len`` tokens, in rank order); the last bound is ``plan.global_len``.
    """
    real_end = plan.cp_size * plan.real_local_len
    bounds = [*plan.global_starts, real_end]
    if plan.stream_pad_len:
        bounds += [real_end + (k + 1) * plan.stream_pad_len for k in range(plan.cp_size)]
    return bounds


def rank_major_to_global(plan: ZigzagPlan) -> torch.Tensor:
    """int64 [global_len]: row ``g`` of the global padded stream is row ``index[g]`` of the rank-major stream.

    The rank-major stream is the concatenation of every rank's zigzag local stream in rank order
    (what an all-gather or a sequence-to-heads all-to-all delivers).
    """
    rank_major = torch.cat([plan.for_rank(r).global_index for r in range(plan.cp_size)])
    return torch.argsort(rank_major)


def contiguous_part(plan: ZigzagPlan) -> ContiguousPart:
    """The :class:`ContiguousPart` of ``plan.cp_rank`` for the row described by ``plan``.

    Segments are those of :func:`global_segment_bounds` cut at the part's edges.
    """
    n = plan.local_len
    start, end = plan.cp_rank * n, (plan.cp_rank + 1) * n
    bounds = global_segment_bounds(plan)
    inside = [b - start for b in bounds if start < b < end]
    if end > start:
        cu = torch.tensor([0, *inside, end - start], dtype=torch.int64)
    else:
        cu = torch.zeros(1, dtype=torch.int64)
    continues = start > 0 and start not in bounds
    return ContiguousPart(start=start, end=end, cu_seqlens=cu, continues=continues)


@dataclass(frozen=True, kw_only=True)
class RelayoutPlan:
    """The all-to-all that moves one rank's tokens from the zigzag to the contiguous layout.

    Zigzag -> contiguous on rank r: send ``local[send_index]`` split by ``send_counts`` (one block per
    destination rank, in rank order); receive blocks of ``recv_counts`` from each source rank and write
    the concatenation to ``contiguous[recv_index]``. Contiguous -> zigzag is the same all-to-all with
    the roles swapped: send ``contiguous[recv_index]`` split by ``recv_counts``, write what arrives to
    ``local[send_index]``.
    """

    send_index: torch.Tensor
    send_counts: tuple[int, ...]
    recv_index: torch.Tensor
    recv_counts: tuple[int, ...]


def relayout_plan(plan: ZigzagPlan) -> RelayoutPlan:
    """The :class:`RelayoutPlan` of ``plan.cp_rank`` (every rank's global index is recomputed locally)."""
    n = plan.local_len
    size = plan.cp_size
    mine = plan.global_index
    owner = torch.div(mine, n, rounding_mode="floor") if n else mine
    # Blocks ordered by destination, and inside a block by global index: what the receiver expects.
    order = torch.argsort(owner * plan.global_len + mine, stable=True)
    send_counts = tuple(int((owner == d).sum()) for d in range(size))
    recv_parts, recv_counts = [], []
    lo, hi = plan.cp_rank * n, (plan.cp_rank + 1) * n
    for src in range(size):
        theirs = plan.for_rank(src).global_index
        picked = theirs[(theirs >= lo) & (theirs < hi)]
        recv_parts.append(torch.sort(picked).values - lo)
        recv_counts.append(int(picked.numel()))
    return RelayoutPlan(
        send_index=order,
        send_counts=send_counts,
        recv_index=torch.cat(recv_parts) if recv_parts else torch.zeros(0, dtype=torch.int64),
        recv_counts=tuple(recv_counts),
    )


def zigzag_to_contiguous_permutation(plans: list[ZigzagPlan]) -> torch.Tensor:
    """int64 [global_len]: for the rank-major concatenation of all zigzag streams, the global index of each token.

    ``contiguous_stream = zeros(global_len).index_copy(0, perm, cat(local_streams))``; the contiguous
    stream cut in C equal parts is the contiguous layout. Its argsort is the inverse permutation.
    """
    return torch.cat([p.global_index for p in plans])
