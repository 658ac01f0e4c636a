"""Datums -> packed rows -> microbatches per DP rank, under the per-rank token budget (pure index math).

A row is one microbatch: datums concatenated in request order (THD), later split over the CP group by
the zigzag layout. A row's per-rank length is ``sum(2·ceil(n_i / 2C))`` rounded up to the stream pad
multiple; rows are filled greedily in request order while that stays within the budget. Rows go to DP
ranks round-robin, and every DP rank runs the same number of microbatches: the short ones get pad-only
microbatches (an idle rank still joins every collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtune.errors import UserInputError
from ringtune.layout.zigzag import chunk_len, stream_pad_multiple

MIN_LOCAL_LEN = 8
"""Smallest per-rank row: covers a conv halo (kernel - 1 <= 7) for chunkwise GDN even in pad-only rows."""


@dataclass(frozen=True, kw_only=True)
class PackingPlan:
    """Which datums each DP rank runs in each microbatch.

    Attributes:
        rows: ``rows[d][m]`` = indices (into the request) of the datums of DP rank d's microbatch m; an
            empty tuple is a pad-only microbatch. Every ``rows[d]`` has the same length.
        local_lens: ``local_lens[d][m]`` = per-rank tokens of that microbatch (what ``pad_to`` is given).
    """

    rows: tuple[tuple[tuple[int, ...], ...], ...]
    local_lens: tuple[tuple[int, ...], ...]

    @property
    def microbatches_per_rank(self) -> int:
        return len(self.rows[0])


def _roundup(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_local_len(lengths: list[int] | tuple[int, ...], *, cp_size: int, multiple: int) -> int:
    """Per-rank tokens of a row of sequences ``lengths`` (at least :data:`MIN_LOCAL_LEN`, rounded to ``multiple``)."""
    natural = sum(2 * chunk_len(n, cp_size) for n in lengths)
    return _roundup(max(natural, MIN_LOCAL_LEN), multiple)


def pack_datums(
    lengths: list[int] | tuple[int, ...],
    *,
    dp_size: int,
    cp_size: int,
    max_tokens_per_rank: int,
    tp_size: int = 1,
    pad_multiplier: int = 8,
) -> PackingPlan:
    """Pack datums of ``lengths`` tokens into rows within ``max_tokens_per_rank`` per rank, spread over DP.

    Raises:
        UserInputError: no datums, a datum of < 1 token, or a datum whose own row exceeds the budget
            (the message names the datum, its length, its per-rank tokens and the budget). Checked for
            every datum before any row is built.
    """
    multiple = stream_pad_multiple(tp_size, pad_multiplier)
    if not lengths:
        raise UserInputError("data: the request holds no datums")
    if max_tokens_per_rank < row_local_len([], cp_size=cp_size, multiple=multiple):
        raise UserInputError(f"max_tokens_per_rank={max_tokens_per_rank} is below one pad-only row")
    for i, n in enumerate(lengths):
        if n < 1:
            raise UserInputError(f"data[{i}].model_input: {n} tokens; a datum needs at least 1")
        own = row_local_len([n], cp_size=cp_size, multiple=multiple)
        if own > max_tokens_per_rank:
            raise UserInputError(
                f"data[{i}]: {n} tokens need {own} tokens per rank at CP={cp_size}, over the per-rank budget "
                f"max_tokens_per_rank={max_tokens_per_rank} (longest datum that fits: "
                f"{max_datum_len(max_tokens_per_rank, cp_size=cp_size, multiple=multiple)} tokens)"
            )
    rows: list[list[int]] = []
    for i, n in enumerate(lengths):
        if rows and row_local_len([lengths[j] for j in rows[-1]] + [n], cp_size=cp_size, multiple=multiple) <= (
            max_tokens_per_rank
        ):
            rows[-1].append(i)
        else:
            rows.append([i])
    per_rank = -(-len(rows) // dp_size)
    plan_rows, plan_lens = [], []
    for d in range(dp_size):
        mine = [tuple(rows[j]) for j in range(d, len(rows), dp_size)]
        mine += [()] * (per_rank - len(mine))
        plan_rows.append(tuple(mine))
        plan_lens.append(
            tuple(row_local_len([lengths[j] for j in r], cp_size=cp_size, multiple=multiple) for r in mine)
        )
    return PackingPlan(rows=tuple(plan_rows), local_lens=tuple(plan_lens))


def max_datum_len(max_tokens_per_rank: int, *, cp_size: int, multiple: int) -> int:
    """The longest datum whose own row fits ``max_tokens_per_rank`` per rank."""
    per_rank = max_tokens_per_rank // multiple * multiple
    return (per_rank // 2) * 2 * cp_size if per_rank >= MIN_LOCAL_LEN else 0
