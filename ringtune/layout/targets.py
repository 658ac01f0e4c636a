"""Which scored targets of a datum a CP rank holds (pure index math).

A datum row of ``T`` tokens whose last ``R`` logit positions are scored (``P = T - R``): the logit at
position ``p`` predicts the label of target ``p - (P-1)``, for ``p`` in ``[P-1, T-1)``. With rank
``r``'s chunks ``C0, C1`` from :func:`~ringtune.layout.zigzag.zigzag_chunk_ranges`, the scored logit
ranges are ``Lk = [max(Ck.start, P-1), min(Ck.end, T-1))`` (possibly empty); a full-length per-target
vector ``v`` maps to this rank as ``v[L0 - (P-1)] ++ v[L1 - (P-1)]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringtune.errors import LayoutError
from ringtune.layout.zigzag import zigzag_chunk_ranges


@dataclass(frozen=True, kw_only=True)
class ScoredTargets:
    """The scored targets of one datum on one CP rank.

    Attributes:
        logit_ranges: the two ranges ``[lo, hi)`` of scored logit positions inside the datum (may be empty).
        target_ranges: the same ranges as target indices, ``[lo-(P-1), hi-(P-1))``.
        local_ranges: the same ranges as offsets inside the datum's local part (``2·c`` tokens).
    """

    seq_len: int
    num_scored: int
    logit_ranges: tuple[tuple[int, int], tuple[int, int]]
    target_ranges: tuple[tuple[int, int], tuple[int, int]]
    local_ranges: tuple[tuple[int, int], tuple[int, int]]

    @property
    def count(self) -> int:
        """How many targets this rank holds for the datum (0 is possible)."""
        return sum(hi - lo for lo, hi in self.target_ranges)

    def target_index(self) -> torch.Tensor:
        """int64 [count]: the target indices this rank holds, in local order."""
        return torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in self.target_ranges])

    def local_index(self) -> torch.Tensor:
        """int64 [count]: offsets of those logits inside the datum's local part, in local order."""
        return torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in self.local_ranges])

    def slice_targets(self, values: torch.Tensor) -> torch.Tensor:
        """``v[L0-(P-1)] ++ v[L1-(P-1)]`` of a full-length per-target vector (a new tensor, never in place)."""
        if values.shape[0] != self.num_scored:
            raise LayoutError(f"per-target vector has {values.shape[0]} entries, the datum scores {self.num_scored}")
        return values.index_select(0, self.target_index().to(values.device))


def scored_targets(seq_len: int, num_scored: int, cp_size: int, cp_rank: int) -> ScoredTargets:
    """The :class:`ScoredTargets` of a datum of ``seq_len`` tokens with its last ``num_scored`` logits scored.

    Requires ``0 <= num_scored <= seq_len - 1`` (the last token has no label inside the row).
    """
    if not 0 <= num_scored <= seq_len - 1:
        raise LayoutError(
            f"num_scored={num_scored} must be in [0, seq_len-1={seq_len - 1}] for a datum of {seq_len} tokens"
        )
    first = seq_len - num_scored - 1  # P - 1: the first scored logit position
    chunks = zigzag_chunk_ranges(seq_len, cp_size, cp_rank)
    logit, target, local = [], [], []
    offset = 0
    for start, end in chunks:
        lo, hi = max(start, first), min(end, seq_len - 1)
        hi = max(hi, lo)
        logit.append((lo, hi))
        target.append((lo - first, hi - first))
        local.append((offset + lo - start, offset + hi - start))
        offset += end - start
    return ScoredTargets(
        seq_len=seq_len,
        num_scored=num_scored,
        logit_ranges=(logit[0], logit[1]),
        target_ranges=(target[0], target[1]),
        local_ranges=(local[0], local[1]),
    )
