"""The zigzag THD layout: which tokens of a packed row each CP rank holds.

Pure index math (torch tensors of int64, no torch.distributed). See docs/layout.md and
docs/context-parallel.md sections 1 and 2.

A packed row is ``sum(seq_lens)`` tokens: the sequences back to back. For CP size ``C`` and a
sequence of ``T`` tokens, ``c = ceil(T / (2C))``; the sequence is padded at its tail to ``2C·c`` and
cut into 2C chunks of ``c`` tokens; rank ``r`` keeps chunks ``r`` and ``2C-1-r``. The local parts of
all sequences are concatenated, then the local stream is padded to a multiple of
``pad = tp_size * pad_multiplier`` (or up to ``pad_to``) by one extra fake sequence, the stream pad.

Global padded stream: every sequence padded to ``2C·c`` back to back, then the C stream pads in
rank order (rank r's stream pad is the r-th block). Its length is ``C * local_len``; ``global_index``
maps each local token into it. The stream pad is local to its rank: no real token sees it.

Every function here derives from :func:`zigzag_chunk_ranges`, the one offsets function.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ringtune.errors import LayoutError

PAD_INDEX = -1
"""Value of ``row_index`` for a local token that is padding (tail pad or stream pad)."""


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise LayoutError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise LayoutError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")


def chunk_len(seq_len: int, cp_size: int) -> int:
    """Chunk length ``c = ceil(seq_len / (2·cp_size))`` of one sequence (seq_len >= 1)."""
    if seq_len < 1:
        raise LayoutError(f"every sequence needs at least 1 token, got seq_len={seq_len}")
    return -(-seq_len // (2 * cp_size))


def zigzag_chunk_ranges(seq_len: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The one offsets function: the two chunks rank ``cp_rank`` keeps of a sequence.

    Returns ``((s0, e0), (s1, e1))`` in the sequence's own padded coordinates ``[0, 2C·c)``:
    chunk ``r`` is ``[r·c, (r+1)·c)`` and chunk ``2C-1-r`` is ``[(2C-1-r)·c, (2C-r)·c)``.
    Positions ``>= seq_len`` are tail padding.
    """
    _check_cp(cp_size, cp_rank)
    c = chunk_len(seq_len, cp_size)
    first = cp_rank
    second = 2 * cp_size - 1 - cp_rank
    return (first * c, (first + 1) * c), (second * c, (second + 1) * c)


def stream_pad_multiple(tp_size: int, pad_multiplier: int) -> int:
    """The multiple the local stream is padded to: ``tp_size * pad_multiplier``."""
    if tp_size < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp_size}")
    if pad_multiplier < 1:
        raise LayoutError(f"pad_multiplier must be >= 1, got {pad_multiplier}")
    return tp_size * pad_multiplier


@dataclass(frozen=True, kw_only=True)
class ZigzagPlan:
    """How one CP rank's local stream maps onto one packed row. Frozen; build with :func:`zigzag_plan`.

    Attributes:
        seq_lens: real length of each sequence in the packed row.
        cp_size, cp_rank, tp_size, pad_multiplier: the layout parameters.
        chunk_lens: ``c_i`` of each sequence.
        local_starts: start of each sequence's local part (``2·c_i`` tokens) in the local stream.
        real_local_len: ``sum(2·c_i)``, the local tokens that belong to sequences (tail pads included).
        stream_pad_len: tokens of the stream pad at the end of the local stream.
        local_len: ``real_local_len + stream_pad_len``; a multiple of ``tp_size*pad_multiplier``.
    """

    seq_lens: tuple[int, ...]
    cp_size: int
    cp_rank: int
    tp_size: int
    pad_multiplier: int
    chunk_lens: tuple[int, ...]
    local_starts: tuple[int, ...]
    real_local_len: int
    stream_pad_len: int

    @property
    def local_len(self) -> int:
        return self.real_local_len + self.stream_pad_len

    @property
    def row_len(self) -> int:
        """Tokens of the unpadded packed row, ``sum(seq_lens)``."""
        return sum(self.seq_lens)

    @property
    def global_len(self) -> int:
        """Tokens of the global padded stream, ``cp_size * local_len``."""
        return self.cp_size * self.local_len

    @cached_property
    def row_starts(self) -> tuple[int, ...]:
        """Start of each sequence in the unpadded packed row."""
        starts, acc = [], 0
        for n in self.seq_lens:
            starts.append(acc)
            acc += n
        return tuple(starts)

    @cached_property
    def global_starts(self) -> tuple[int, ...]:
        """Start of each sequence in the global padded stream (sequences padded to ``2C·c_i``)."""
        return tuple(start * self.cp_size for start in self.local_starts)

    @cached_property
    def chunk_ranges(self) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
        """:func:`zigzag_chunk_ranges` of every sequence, in sequence coordinates."""
        return tuple(zigzag_chunk_ranges(n, self.cp_size, self.cp_rank) for n in self.seq_lens)

    @cached_property
    def local_cu_seqlens(self) -> torch.Tensor:
        """int64 [n_seq + 1 (+1 if stream pad)]: local sequence boundaries; the stream pad is the last segment."""
        bounds = [*self.local_starts, self.real_local_len]
        if self.stream_pad_len:
            bounds.append(self.local_len)
        return torch.tensor(bounds, dtype=torch.int64)

    @cached_property
    def global_cu_seqlens(self) -> torch.Tensor:
        """int64: ``local_cu_seqlens * cp_size``; each sequence segment is a multiple of ``2·cp_size``."""
        return self.local_cu_seqlens * self.cp_size

    @cached_property
    def _per_token(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # (row_index, position, global_index) of every local token, derived from chunk_ranges.
        row_parts, pos_parts, glob_parts = [], [], []
        for n, row_start, glob_start, ranges in zip(
            self.seq_lens, self.row_starts, self.global_starts, self.chunk_ranges, strict=True
        ):
            for start, end in ranges:
                pos = torch.arange(start, end, dtype=torch.int64)
                pos_parts.append(pos)
                glob_parts.append(pos + glob_start)
                row_parts.append(torch.where(pos < n, pos + row_start, PAD_INDEX))
        pad = torch.arange(self.stream_pad_len, dtype=torch.int64)
        pos_parts.append(pad)
        glob_parts.append(pad + self.cp_size * self.real_local_len + self.cp_rank * self.stream_pad_len)
        row_parts.append(torch.full((self.stream_pad_len,), PAD_INDEX, dtype=torch.int64))
        return torch.cat(row_parts), torch.cat(pos_parts), torch.cat(glob_parts)

    @cached_property
    def row_index(self) -> torch.Tensor:
        """int64 [local_len]: index of each local token in the unpadded packed row, ``PAD_INDEX`` for pads."""
        return self._per_token[0]

    @cached_property
    def positions(self) -> torch.Tensor:
        """int64 [local_len]: global position of each local token inside its own sequence.

        Tail pads continue their sequence's count; the stream pad counts from 0 on each rank.
        Never ``arange(local_len)``.
        """
        return self._per_token[1]

    @cached_property
    def global_index(self) -> torch.Tensor:
        """int64 [local_len]: index of each local token in the global padded stream (length ``global_len``)."""
        return self._per_token[2]

    @cached_property
    def is_real(self) -> torch.Tensor:
        """bool [local_len]: True where the local token is a real token of the row."""
        return self.row_index != PAD_INDEX

    def for_rank(self, cp_rank: int) -> ZigzagPlan:
        """The plan of another rank of the same row (every rank can build every plan)."""
        return zigzag_plan(
            self.seq_lens,
            cp_size=self.cp_size,
            cp_rank=cp_rank,
            tp_size=self.tp_size,
            pad_multiplier=self.pad_multiplier,
            pad_to=self.local_len,
        )


def zigzag_plan(
    seq_lens: tuple[int, ...] | list[int],
    *,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
    pad_multiplier: int = 128,
    pad_to: int | None = None,
) -> ZigzagPlan:
    """Build the :class:`ZigzagPlan` of one packed row for one CP rank.

    Args:
        seq_lens: real length of every sequence of the row, each >= 1; may be empty (a pad-only row).
        cp_size, cp_rank: CP group size and this rank's index in it.
        tp_size, pad_multiplier: the local stream is padded to a multiple of ``tp_size*pad_multiplier``.
        pad_to: if given, pad the local stream to exactly this many tokens instead (a per-rank budget);
            it must be a multiple of ``tp_size*pad_multiplier`` and >= ``sum(2·c_i)``.
    Raises:
        LayoutError: naming the field, its value and the limit.
    """
    _check_cp(cp_size, cp_rank)
    multiple = stream_pad_multiple(tp_size, pad_multiplier)
    seq_lens = tuple(int(n) for n in seq_lens)
    for i, n in enumerate(seq_lens):
        if n < 1:
            raise LayoutError(f"seq_lens[{i}]={n}: every sequence needs at least 1 token")
    chunk_lens = tuple(chunk_len(n, cp_size) for n in seq_lens)
    local_starts, acc = [], 0
    for c in chunk_lens:
        local_starts.append(acc)
        acc += 2 * c
    real_local_len = acc
    if pad_to is None:
        local_len = -(-real_local_len // multiple) * multiple
    else:
        if pad_to % multiple:
            raise LayoutError(f"pad_to={pad_to} must be a multiple of tp_size*pad_multiplier={multiple}")
        if pad_to < real_local_len:
            raise LayoutError(
                f"pad_to={pad_to} is below the {real_local_len} local tokens this row needs at "
                f"cp_size={cp_size}; raise the per-rank token budget or split the row"
            )
        local_len = pad_to
    return ZigzagPlan(
        seq_lens=seq_lens,
        cp_size=cp_size,
        cp_rank=cp_rank,
        tp_size=tp_size,
        pad_multiplier=pad_multiplier,
        chunk_lens=chunk_lens,
        local_starts=tuple(local_starts),
        real_local_len=real_local_len,
        stream_pad_len=local_len - real_local_len,
    )


def zigzag_slice(row: torch.Tensor, plan: ZigzagPlan, *, dim: int = 0, pad_value: float = 0) -> torch.Tensor:
    """This rank's local stream of a full packed row.

    Args:
        row: a tensor whose ``dim`` has ``plan.row_len`` entries (tokens, labels, weights, hidden states...).
        pad_value: value written at tail pads and the stream pad.
    Returns:
        a new tensor with ``plan.local_len`` entries along ``dim`` (never a view of ``row``).
    """
    if row.shape[dim] != plan.row_len:
        raise LayoutError(f"row has {row.shape[dim]} entries along dim {dim}, the plan expects {plan.row_len}")
    if plan.row_len == 0:  # a pad-only row: nothing to pick (index_select on an empty dim would fail)
        shape = list(row.shape)
        shape[dim] = plan.local_len
        return row.new_full(shape, pad_value)
    index = plan.row_index.to(row.device)
    picked = row.index_select(dim, index.clamp(min=0))
    shape = [1] * row.dim()
    shape[dim] = -1
    mask = (index == PAD_INDEX).view(shape)
    return picked.masked_fill(mask, pad_value)


def zigzag_place(local: torch.Tensor, plan: ZigzagPlan, *, dim: int = 0) -> torch.Tensor:
    """Scatter one rank's local stream into a zero full-length row (pads dropped).

    The sum over all CP ranks of ``zigzag_place`` is the full row: each real token lives on one rank.
    Returns a tensor with ``plan.row_len`` entries along ``dim``.
    """
    if local.shape[dim] != plan.local_len:
        raise LayoutError(f"local has {local.shape[dim]} entries along dim {dim}, the plan expects {plan.local_len}")
    keep = plan.is_real.nonzero().squeeze(1).to(local.device)
    shape = list(local.shape)
    shape[dim] = plan.row_len
    out = local.new_zeros(shape)
    return out.index_copy(dim, plan.row_index.to(local.device)[keep], local.index_select(dim, keep))


def zigzag_unslice(parts: list[torch.Tensor], plans: list[ZigzagPlan], *, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`zigzag_slice`: rebuild the full row from every rank's local stream (rank order)."""
    if len(parts) != len(plans) or not parts:
        raise LayoutError(f"need one part per CP rank, got {len(parts)} parts and {len(plans)} plans")
    out = zigzag_place(parts[0], plans[0], dim=dim)
    for part, plan in zip(parts[1:], plans[1:], strict=True):
        out = out + zigzag_place(part, plan, dim=dim)
    return out
