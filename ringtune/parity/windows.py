"""Where each scored position of a parity datum sits in the server's layout: zigzag chunk, chunk boundaries,
chunkwise-GatedDeltaNet split rows. Computed from :mod:`ringtune.layout` and the engine's own packing
(:func:`ringtune.engine.packing.pack_datums`), never guessed: the same functions place the tokens on the server.

Position ``p`` of a datum is the logit at model-input index ``p`` (it scores ``target_tokens[p]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ringtune.engine.packing import pack_datums
from ringtune.layout.contiguous import contiguous_part
from ringtune.layout.zigzag import chunk_len, zigzag_plan

BOUNDARY_HALF_WIDTH = 2
"""Positions ``[b - 2, b + 2)`` around a zigzag chunk boundary ``b`` are "near" it: a one-token misalignment at a
boundary (a label or position taken from the neighbouring chunk) lands there."""

SPLIT_WINDOW = (2, 16)
"""Positions ``[s - 2, s + 16)`` around a GDN split row ``s``: the conv halo reaches 3 rows past ``s``, and a lost
state hand-off shows most in the rows right after it (it decays with the gates further on)."""


@dataclass(frozen=True)
class Layout:
    """What decides where tokens go: CP and DP sizes, the per-rank token budget and the stream pad multiplier."""

    cp_size: int
    dp_size: int
    max_tokens_per_rank: int
    pad_multiplier: int

    @classmethod
    def from_dump(cls, layout: Mapping[str, object]) -> Layout:
        return cls(
            cp_size=int(layout["cp_size"]),  # type: ignore[arg-type]
            dp_size=int(layout["dp_size"]),  # type: ignore[arg-type]
            max_tokens_per_rank=int(layout["max_tokens_per_rank"]),  # type: ignore[arg-type]
            pad_multiplier=int(layout.get("pad_multiplier", 8)),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class DatumPositions:
    """Classes of the ``n`` positions of one datum under one layout.

    Attributes:
        chunk: int [n], the zigzag chunk (0 .. 2C-1) of each position.
        boundaries: the interior chunk boundaries ``k·c`` (k = 1 .. 2C-1) that fall inside the datum.
        near_boundary: int [n], the index k of the boundary a position is near (-1: none).
        splits: the datum positions where a chunkwise-GDN contiguous part starts inside the datum (a state
            hand-off), from the datum's packed row.
        near_split: int [n], the index into ``splits`` of the split window a position is in (-1: none).
    """

    chunk: np.ndarray
    boundaries: tuple[int, ...]
    near_boundary: np.ndarray
    splits: tuple[int, ...]
    near_split: np.ndarray

    @property
    def interior(self) -> np.ndarray:
        """bool [n]: positions near no chunk boundary and in no split window."""
        return (self.near_boundary < 0) & (self.near_split < 0)


def _datum_positions(n: int, cp: int, splits: Sequence[int]) -> DatumPositions:
    c = chunk_len(n, cp)
    p = np.arange(n)
    chunk = p // c
    boundaries = tuple(k * c for k in range(1, 2 * cp) if k * c < n)
    near_b = np.full(n, -1)
    for k, b in enumerate(boundaries, start=1):
        lo, hi = max(b - BOUNDARY_HALF_WIDTH, 0), min(b + BOUNDARY_HALF_WIDTH, n)
        near_b[lo:hi] = k
    near_s = np.full(n, -1)
    for j, s in enumerate(splits):
        lo, hi = max(s - SPLIT_WINDOW[0], 0), min(s + SPLIT_WINDOW[1], n)
        near_s[lo:hi] = j
    return DatumPositions(chunk, boundaries, near_b, tuple(splits), near_s)


def request_positions(lengths: Sequence[int], layout: Layout) -> list[DatumPositions]:
    """The positions of every datum of one request (``lengths`` in request order) as ``layout`` packs them.

    Rows come from :func:`pack_datums` (the engine's packer); each row's zigzag plan and its contiguous parts
    (:func:`contiguous_part`) give the global rows where chunkwise GDN hands its state over: rank r's part starts
    at ``r · local_len`` of the row's global padded stream, and datum i occupies ``[C·local_starts[i], +n_i)``.
    """
    cp = layout.cp_size
    plan = pack_datums(
        list(lengths),
        dp_size=layout.dp_size,
        cp_size=cp,
        max_tokens_per_rank=layout.max_tokens_per_rank,
        pad_multiplier=layout.pad_multiplier,
    )
    splits: dict[int, list[int]] = {i: [] for i in range(len(lengths))}
    for rows, local_lens in zip(plan.rows, plan.local_lens, strict=True):
        for row, local_len in zip(rows, local_lens, strict=True):
            if not row or cp == 1:
                continue
            seq_lens = [lengths[i] for i in row]
            row_plan = zigzag_plan(
                seq_lens, cp_size=cp, cp_rank=0, pad_multiplier=layout.pad_multiplier, pad_to=local_len
            )
            starts = list(row_plan.global_starts)
            for r in range(1, cp):
                split = contiguous_part(row_plan.for_rank(r)).start
                for i, start, n in zip(row, starts, seq_lens, strict=True):
                    if start < split < start + n:  # a part boundary inside the datum's real tokens
                        splits[i].append(split - start)
    return [_datum_positions(n, cp, splits[i]) for i, n in enumerate(lengths)]
