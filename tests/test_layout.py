"""Tests of ringtune.layout: the zigzag THD layout, scored targets, budget and contiguous relayout.

Single process, pure index math. Every property is checked against a reference built here directly
from the contract (docs/layout.md, docs/context-parallel.md section 1), not from the plan's
own index tensors: the global padded stream is assembled from ``ceil(T/(2C))`` by hand and each
rank's local stream is cut out of it with the doc's chunk formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtune.errors import LayoutError, UserInputError
from ringtune.layout import (
    PAD_INDEX,
    ZigzagPlan,
    chunk_len,
    contiguous_part,
    rank_token_budget,
    relayout_plan,
    scored_targets,
    zigzag_chunk_ranges,
    zigzag_place,
    zigzag_plan,
    zigzag_slice,
    zigzag_unslice,
)
from ringtune.layout.contiguous import zigzag_to_contiguous_permutation

PROPERTY = settings(max_examples=150, deadline=None)
MAX_ROW_TOKENS = 12_000


# ---------------------------------------------------------------------------------------------------------------
# Independent reference of the layout, straight from the contract.


def ref_chunk(n: int, cp_size: int) -> int:
    return math.ceil(n / (2 * cp_size))


def ref_segments(seq_lens: tuple[int, ...], cp_size: int, local_len: int) -> list[tuple[int, int, int]]:
    """Segments ``(global_start, global_len, real_len)`` of the global padded stream.

    Every sequence padded at its tail to ``2C·c``, back to back, then the C stream pads in rank order
    (real_len = 0 marks a stream pad).
    """
    segs, acc = [], 0
    for n in seq_lens:
        padded = 2 * cp_size * ref_chunk(n, cp_size)
        segs.append((acc, padded, n))
        acc += padded
    stream_pad = local_len - acc // cp_size
    if stream_pad:
        for k in range(cp_size):
            segs.append((acc + k * stream_pad, stream_pad, 0))
    return segs


def ref_global_stream(row: torch.Tensor, seq_lens: tuple[int, ...], cp_size: int, local_len: int) -> torch.Tensor:
    """The global padded stream of a row (dim 0 = tokens), pads 0."""
    out = row.new_zeros((cp_size * local_len, *row.shape[1:]))
    row_start = 0
    for start, _, real in ref_segments(seq_lens, cp_size, local_len):
        out[start : start + real] = row[row_start : row_start + real]
        row_start += real
    return out


def ref_local_stream(
    stream: torch.Tensor, seq_lens: tuple[int, ...], cp_size: int, cp_rank: int, local_len: int
) -> torch.Tensor:
    """Rank ``cp_rank``'s zigzag local stream cut out of a global padded stream with the doc's formula."""
    parts = []
    for start, length, real in ref_segments(seq_lens, cp_size, local_len):
        if real == 0:
            continue
        c = length // (2 * cp_size)
        x = stream[start : start + length]
        parts.append(x[cp_rank * c : (cp_rank + 1) * c])
        parts.append(x[(2 * cp_size - 1 - cp_rank) * c : (2 * cp_size - cp_rank) * c])
    real_total = sum(length for _, length, real in ref_segments(seq_lens, cp_size, local_len) if real)
    stream_pad = local_len - real_total // cp_size
    pad_start = real_total + cp_rank * stream_pad
    parts.append(stream[pad_start : pad_start + stream_pad])
    return torch.cat(parts)


def all_plans(seq_lens, cp_size, **kw) -> list[ZigzagPlan]:
    return [zigzag_plan(seq_lens, cp_size=cp_size, cp_rank=r, **kw) for r in range(cp_size)]


def segment_of(cu: torch.Tensor, n: int) -> torch.Tensor:
    """Segment id of each of ``n`` local tokens given segment boundaries ``cu``."""
    return torch.searchsorted(cu, torch.arange(n, dtype=torch.int64), right=True) - 1


# ---------------------------------------------------------------------------------------------------------------
# Strategies.


@st.composite
def packed_rows(draw, max_cp: int = 8):
    """A packed row of 1..8 sequences of 1..5000 tokens (total capped), plus layout parameters."""
    lens = draw(st.lists(st.one_of(st.integers(1, 20), st.integers(1, 5000)), min_size=1, max_size=8))
    kept, total = [], 0
    for n in lens:
        if kept and total + n > MAX_ROW_TOKENS:
            break
        kept.append(n)
        total += n
    cp_size = draw(st.integers(1, max_cp))
    tp_size = draw(st.sampled_from([1, 2, 4]))
    pad_multiplier = draw(st.sampled_from([1, 8, 128]))
    extra_blocks = draw(st.sampled_from([None, 0, 1, 3]))  # None: default padding; k: pad_to = minimum + k·multiple
    pad_to = None
    if extra_blocks is not None:
        multiple = tp_size * pad_multiplier
        need = sum(2 * ref_chunk(n, cp_size) for n in kept)
        pad_to = (math.ceil(need / multiple) + extra_blocks) * multiple
    seed = draw(st.integers(0, 2**31 - 1))
    return tuple(kept), dict(cp_size=cp_size, tp_size=tp_size, pad_multiplier=pad_multiplier, pad_to=pad_to), seed


# ---------------------------------------------------------------------------------------------------------------
# 1. Slice / unslice / place round trip.


@PROPERTY
@given(packed_rows())
def test_slice_unslice_round_trip(case):
    seq_lens, kw, seed = case
    gen = torch.Generator().manual_seed(seed)
    plans = all_plans(seq_lens, **kw)
    T = sum(seq_lens)
    tokens = torch.randint(1, 1 << 40, (T,), generator=gen, dtype=torch.int64)
    hidden = torch.randn(T, 3, generator=gen, dtype=torch.float64)

    for row in (tokens, hidden):
        parts = [zigzag_slice(row, p) for p in plans]
        assert all(part.shape == (plans[0].local_len, *row.shape[1:]) for part in parts)
        assert all(part.dtype == row.dtype for part in parts)
        assert torch.equal(zigzag_unslice(parts, plans), row)
        placed = [zigzag_place(part, p) for part, p in zip(parts, plans, strict=True)]
        assert torch.equal(sum(placed[1:], placed[0]), row)
        # each rank's local stream is the doc's formula applied to the global padded stream
        stream = ref_global_stream(row, seq_lens, kw["cp_size"], plans[0].local_len)
        for r, part in enumerate(parts):
            assert torch.equal(part, ref_local_stream(stream, seq_lens, kw["cp_size"], r, plans[0].local_len))

    # along a non-leading dim, and a fresh tensor (never a view of the row)
    wide = hidden.T.contiguous()
    parts = [zigzag_slice(wide, p, dim=-1, pad_value=-7.0) for p in plans]
    assert torch.equal(zigzag_unslice(parts, plans, dim=-1), wide)
    for part, p in zip(parts, plans, strict=True):
        assert bool((part[:, ~p.is_real] == -7.0).all())
    parts[0].fill_(123.0)
    assert not bool((wide == 123.0).any())


# ---------------------------------------------------------------------------------------------------------------
# 2. Plan invariants.


@PROPERTY
@given(packed_rows())
def test_plan_invariants(case):
    seq_lens, kw, _ = case
    C, multiple = kw["cp_size"], kw["tp_size"] * kw["pad_multiplier"]
    plans = all_plans(seq_lens, **kw)
    chunks = [ref_chunk(n, C) for n in seq_lens]
    row_starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
    need = sum(2 * c for c in chunks)
    expected_len = math.ceil(need / multiple) * multiple if kw["pad_to"] is None else kw["pad_to"]
    n_seq = len(seq_lens)

    for r, p in enumerate(plans):
        assert p.cp_rank == r
        assert p.chunk_lens == tuple(chunks)
        assert p.local_len == sum(2 * c for c in chunks) + p.stream_pad_len == expected_len
        assert p.local_len % multiple == 0
        assert p.global_len == C * p.local_len
        assert torch.equal(p.global_cu_seqlens, p.local_cu_seqlens * C)
        seg = p.global_cu_seqlens.diff()
        assert bool((seg[:n_seq] % (2 * C) == 0).all())
        assert seg[:n_seq].tolist() == [2 * C * c for c in chunks]
        assert p.local_cu_seqlens.numel() == n_seq + 1 + (1 if p.stream_pad_len else 0)
        assert p.for_rank((r + 1) % C) == plans[(r + 1) % C]

        for t in (p.row_index, p.positions, p.global_index):
            assert t.dtype == torch.int64 and t.shape == (p.local_len,)
        # the local stream keeps global order (so each all-to-all send block is a run of the local stream)
        assert bool((p.global_index.diff() > 0).all())
        real = p.is_real
        assert torch.equal(real, p.row_index != PAD_INDEX)
        seg_id = segment_of(p.local_cu_seqlens, p.local_len)
        lens = torch.tensor([*seq_lens, 0], dtype=torch.int64)  # 0: the stream pad
        starts = torch.tensor([*row_starts, 0], dtype=torch.int64)
        # real tokens: position == offset inside their sequence, and < seq_len
        assert torch.equal(p.positions[real], p.row_index[real] - starts[seg_id[real]])
        assert bool((p.positions[real] < lens[seg_id[real]]).all())
        # tail pads sit past every real token of their sequence, inside its padded length
        tail = ~real & (seg_id < n_seq)
        assert bool((p.positions[tail] >= lens[seg_id[tail]]).all())
        assert bool((p.positions[tail] < 2 * C * torch.tensor([*chunks, 0])[seg_id[tail]]).all())
        # the stream pad counts from 0 on every rank and holds no real token
        assert bool((~real[p.real_local_len :]).all())
        assert torch.equal(p.positions[p.real_local_len :], torch.arange(p.stream_pad_len))
        # positions follow the one offsets function
        for i, (n, ranges) in enumerate(zip(seq_lens, p.chunk_ranges, strict=True)):
            assert ranges == zigzag_chunk_ranges(n, C, r)
            local = p.positions[p.local_starts[i] : p.local_starts[i] + 2 * chunks[i]]
            expected = torch.cat([torch.arange(s, e) for s, e in ranges])
            assert torch.equal(local, expected)

    assert len({p.local_len for p in plans}) == 1
    every_global = torch.cat([p.global_index for p in plans])
    assert torch.equal(every_global.sort().values, torch.arange(plans[0].global_len))
    every_real = torch.cat([p.row_index[p.is_real] for p in plans])
    assert torch.equal(every_real.sort().values, torch.arange(sum(seq_lens)))
    # in global order each segment holds its real tokens first, then its pads
    g_all = torch.cat([p.global_index for p in plans])
    real_all = torch.cat([p.is_real for p in plans])
    for start, length, real in ref_segments(seq_lens, C, plans[0].local_len):
        here = (g_all >= start) & (g_all < start + length)
        assert torch.equal(g_all[here & real_all].sort().values, torch.arange(start, start + real))
        assert torch.equal(g_all[here & ~real_all].sort().values, torch.arange(start + real, start + length))


def test_plan_worked_case():
    # seq_lens (5, 9) at CP2: c = (2, 3); local parts of 4 + 6 = 10 tokens, padded to 16 (multiplier 8)
    p0 = zigzag_plan([5, 9], cp_size=2, cp_rank=0, pad_multiplier=8)
    p1 = p0.for_rank(1)
    assert p0.chunk_lens == (2, 3) and p0.local_starts == (0, 4)
    assert (p0.real_local_len, p0.stream_pad_len, p0.local_len) == (10, 6, 16)
    assert p0.local_cu_seqlens.tolist() == [0, 4, 10, 16]
    assert p0.global_cu_seqlens.tolist() == [0, 8, 20, 32]
    assert p0.positions.tolist() == [0, 1, 6, 7, 0, 1, 2, 9, 10, 11, 0, 1, 2, 3, 4, 5]
    assert p1.positions.tolist() == [2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5]
    P = PAD_INDEX
    assert p0.row_index.tolist() == [0, 1, P, P, 5, 6, 7, P, P, P, *[P] * 6]
    assert p1.row_index.tolist() == [2, 3, 4, P, 8, 9, 10, 11, 12, 13, *[P] * 6]
    assert p0.global_index.tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19, *range(20, 26)]
    assert p1.global_index.tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16, *range(26, 32)]


def test_chunk_len():
    assert [chunk_len(n, 2) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert zigzag_chunk_ranges(10, 2, 1) == ((3, 6), (6, 9))


# ---------------------------------------------------------------------------------------------------------------
# 3. Budget.


@PROPERTY
@given(
    st.integers(1, 300_000),
    st.integers(1, 8),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 8, 128]),
)
def test_budget_matches_plan(L, C, tp, pm):
    budget = rank_token_budget(L, C, tp_size=tp, pad_multiplier=pm)
    plan = zigzag_plan([L + 1], cp_size=C, cp_rank=C - 1, tp_size=tp, pad_multiplier=pm)
    assert budget == plan.local_len
    assert budget == math.ceil(2 * math.ceil((L + 1) / (2 * C)) / (tp * pm)) * (tp * pm)
    # the budget is a valid pad_to for the row (and for any single shorter datum)
    assert zigzag_plan([L + 1], cp_size=C, cp_rank=0, tp_size=tp, pad_multiplier=pm, pad_to=budget).local_len == budget
    assert zigzag_plan([L // 2 + 1], cp_size=C, cp_rank=0, tp_size=tp, pad_multiplier=pm, pad_to=budget)


def test_budget_worked_numbers():
    L = 131072
    assert rank_token_budget(L, 2, tp_size=4, pad_multiplier=128) == 66048
    assert rank_token_budget(L, 4, tp_size=4, pad_multiplier=128) == 33280
    assert rank_token_budget(L, 8, tp_size=1, pad_multiplier=128) == 16512
    assert rank_token_budget(L, 8) == 16512


# ---------------------------------------------------------------------------------------------------------------
# 4. Scored targets.


def test_scored_targets_worked_cases():
    # (T,R,C)=(13,8,2): rank 0 holds none, rank 1 holds all eight
    none = scored_targets(13, 8, 2, 0)
    assert none.count == 0 and none.target_index().tolist() == []
    assert scored_targets(13, 8, 2, 1).target_index().tolist() == list(range(8))
    # (9,1,2): rank 1 holds target 0 only, rank 0 none
    only = scored_targets(9, 1, 2, 1)
    assert only.target_index().tolist() == [0]
    assert only.logit_ranges[1] == (7, 8)
    assert scored_targets(9, 1, 2, 0).count == 0
    # (12,8,4): rank 2 holds [1,3) + [7,8)
    two = scored_targets(12, 8, 4, 2)
    assert two.target_ranges == ((1, 3), (7, 8))
    assert two.logit_ranges == ((4, 6), (10, 11))
    assert two.local_ranges == ((0, 2), (2, 3))
    assert two.target_index().tolist() == [1, 2, 7]
    assert two.local_index().tolist() == [0, 1, 2]
    v = torch.arange(100.0, 108.0)
    assert two.slice_targets(v).tolist() == [101.0, 102.0, 107.0]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 8), st.data())
def test_scored_targets_partition(T, C, data):
    R = data.draw(st.one_of(st.integers(0, min(T - 1, 16)), st.integers(0, T - 1)))
    P = T - R
    v = torch.randn(R, dtype=torch.float64)
    v_before = v.clone()
    held = []
    for r in range(C):
        st_r = scored_targets(T, R, C, r)
        idx = st_r.target_index()
        assert idx.dtype == torch.int64 and idx.numel() == st_r.count
        held.append(idx)
        sliced = st_r.slice_targets(v)
        assert torch.equal(sliced, v[idx])
        sliced.fill_(float("nan"))
        assert torch.equal(v, v_before)
        # local_index points at local positions p with p - (P-1) == target index
        plan = zigzag_plan([T], cp_size=C, cp_rank=r, pad_multiplier=1)
        loc = st_r.local_index()
        assert loc.numel() == idx.numel()
        assert bool((loc < 2 * plan.chunk_lens[0]).all())
        assert torch.equal(plan.positions[loc] - (P - 1), idx)
        assert bool(plan.is_real[loc].all())
        for (lo, hi), (s, e) in zip(st_r.logit_ranges, zigzag_chunk_ranges(T, C, r), strict=True):
            assert hi - lo >= 0
            if hi > lo:
                assert s <= lo and hi <= e and lo >= P - 1 and hi <= T - 1
    every = torch.cat(held)
    assert every.numel() == R
    assert torch.equal(every.sort().values, torch.arange(R))


# ---------------------------------------------------------------------------------------------------------------
# 5. Contiguous split and the zigzag <-> contiguous relayout.


def simulate_all_to_all(sends: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """``sends[src][dst]`` -> ``recvs[dst][src]``."""
    C = len(sends)
    return [[sends[src][dst] for src in range(C)] for dst in range(C)]


def zigzag_to_contiguous(locals_: list[torch.Tensor], relayouts) -> list[torch.Tensor]:
    sends = [
        list(local[rp.send_index].split(list(rp.send_counts))) for local, rp in zip(locals_, relayouts, strict=True)
    ]
    out = []
    for rp, blocks in zip(relayouts, simulate_all_to_all(sends), strict=True):
        assert [b.shape[0] for b in blocks] == list(rp.recv_counts)
        buf = torch.full((rp.recv_index.numel(), *locals_[0].shape[1:]), -1, dtype=locals_[0].dtype)
        buf[rp.recv_index] = torch.cat(blocks)
        out.append(buf)
    return out


def contiguous_to_zigzag(parts: list[torch.Tensor], relayouts) -> list[torch.Tensor]:
    sends = [list(part[rp.recv_index].split(list(rp.recv_counts))) for part, rp in zip(parts, relayouts, strict=True)]
    out = []
    for rp, blocks in zip(relayouts, simulate_all_to_all(sends), strict=True):
        assert [b.shape[0] for b in blocks] == list(rp.send_counts)
        buf = torch.full((rp.send_index.numel(), *parts[0].shape[1:]), -1, dtype=parts[0].dtype)
        buf[rp.send_index] = torch.cat(blocks)
        out.append(buf)
    return out


@settings(max_examples=80, deadline=None)
@given(packed_rows())
def test_relayout_round_trip(case):
    seq_lens, kw, seed = case
    C = kw["cp_size"]
    plans = all_plans(seq_lens, **kw)
    n = plans[0].local_len
    relayouts = [relayout_plan(p) for p in plans]
    for r, rp in enumerate(relayouts):
        assert sum(rp.send_counts) == n and sum(rp.recv_counts) == n
        assert len(rp.send_counts) == len(rp.recv_counts) == C
        assert torch.equal(rp.send_index.sort().values, torch.arange(n))
        assert torch.equal(rp.recv_index.sort().values, torch.arange(n))
        assert rp.send_counts == tuple(relayouts[d].recv_counts[r] for d in range(C))

    # a stream tag on every global position (pads included), and a real row (pads 0)
    gen = torch.Generator().manual_seed(seed)
    row = torch.randint(1, 1 << 40, (sum(seq_lens),), generator=gen, dtype=torch.int64)
    row_stream = ref_global_stream(row, seq_lens, C, n)
    for stream in (torch.arange(1, C * n + 1), row_stream):
        locals_ = [ref_local_stream(stream, seq_lens, C, r, n) for r in range(C)]
        contiguous = zigzag_to_contiguous(locals_, relayouts)
        for r in range(C):
            assert torch.equal(contiguous[r], stream[r * n : (r + 1) * n])
        back = contiguous_to_zigzag(contiguous, relayouts)
        for r in range(C):
            assert torch.equal(back[r], locals_[r])
    # the local streams built by zigzag_slice go through the same relayout
    contiguous = zigzag_to_contiguous([zigzag_slice(row, p) for p in plans], relayouts)
    assert torch.equal(torch.cat(contiguous), row_stream)
    # and the one-shot permutation agrees
    perm = zigzag_to_contiguous_permutation(plans)
    tags = torch.arange(1, C * n + 1)
    flat = torch.zeros(C * n, dtype=torch.int64).index_copy(
        0, perm, torch.cat([ref_local_stream(tags, seq_lens, C, r, n) for r in range(C)])
    )
    assert torch.equal(flat, tags)


@PROPERTY
@given(packed_rows())
def test_contiguous_part(case):
    seq_lens, kw, _ = case
    plans = all_plans(seq_lens, **kw)
    n = plans[0].local_len
    segs = ref_segments(seq_lens, kw["cp_size"], n)
    bounds = {s for s, _, _ in segs} | {s + length for s, length, _ in segs}
    for r, p in enumerate(plans):
        part = contiguous_part(p)
        assert (part.start, part.end) == (r * n, (r + 1) * n)
        cu = part.cu_seqlens
        assert cu.dtype == torch.int64
        assert cu[0].item() == 0 and cu[-1].item() == n
        assert bool((cu.diff() > 0).all())
        inside = sorted(b - part.start for b in bounds if part.start < b < part.end)
        assert cu[1:-1].tolist() == inside
        # continues: some segment starts before this part and runs into it
        crosses = any(s < part.start < s + length for s, length, _ in segs)
        assert part.continues == crosses
    assert contiguous_part(plans[0]).continues is False


def test_contiguous_part_worked_case():
    # seq_lens (5, 9) at CP2, multiplier 8: global stream [seq0: 0..8) [seq1: 8..20) [pad0: 20..26) [pad1: 26..32)
    p0 = zigzag_plan([5, 9], cp_size=2, cp_rank=0, pad_multiplier=8)
    first, second = contiguous_part(p0), contiguous_part(p0.for_rank(1))
    assert first.cu_seqlens.tolist() == [0, 8, 16] and not first.continues
    assert second.cu_seqlens.tolist() == [0, 4, 10, 16] and second.continues


# ---------------------------------------------------------------------------------------------------------------
# 6. Errors: raised where the bad value enters, naming the field.


def test_errors_name_the_field():
    assert issubclass(LayoutError, UserInputError)
    with pytest.raises(LayoutError, match=r"seq_lens\[1\]=0"):
        zigzag_plan([4, 0, 3], cp_size=2, cp_rank=0)
    with pytest.raises(LayoutError, match=r"seq_lens\[0\]=-2"):
        zigzag_plan([-2], cp_size=2, cp_rank=0)
    with pytest.raises(LayoutError, match=r"cp_rank must be in \[0, cp_size=2\), got 2"):
        zigzag_plan([4], cp_size=2, cp_rank=2)
    with pytest.raises(LayoutError, match=r"cp_rank must be in \[0, cp_size=4\), got -1"):
        zigzag_plan([4], cp_size=4, cp_rank=-1)
    with pytest.raises(LayoutError, match=r"cp_size must be >= 1, got 0"):
        zigzag_plan([4], cp_size=0, cp_rank=0)
    with pytest.raises(LayoutError, match=r"tp_size must be >= 1, got 0"):
        zigzag_plan([4], cp_size=1, cp_rank=0, tp_size=0)
    with pytest.raises(LayoutError, match=r"pad_multiplier must be >= 1, got 0"):
        zigzag_plan([4], cp_size=1, cp_rank=0, pad_multiplier=0)
    # 300 tokens at CP2: c = 75, 150 local tokens; pad_to=128 is a multiple but too small
    with pytest.raises(LayoutError, match=r"pad_to=128 is below the 150 local tokens"):
        zigzag_plan([300], cp_size=2, cp_rank=0, pad_to=128)
    with pytest.raises(LayoutError, match=r"pad_to=200 must be a multiple of tp_size\*pad_multiplier=256"):
        zigzag_plan([300], cp_size=2, cp_rank=0, tp_size=2, pad_to=200)
    plan = zigzag_plan([5, 9], cp_size=2, cp_rank=0, pad_multiplier=8)
    with pytest.raises(LayoutError, match=r"row has 13 entries along dim 0, the plan expects 14"):
        zigzag_slice(torch.zeros(13), plan)
    with pytest.raises(LayoutError, match=r"row has 3 entries along dim 1, the plan expects 14"):
        zigzag_slice(torch.zeros(14, 3), plan, dim=1)
    with pytest.raises(LayoutError, match=r"local has 15 entries along dim 0, the plan expects 16"):
        zigzag_place(torch.zeros(15), plan)
    with pytest.raises(LayoutError, match=r"one part per CP rank, got 1 parts and 2 plans"):
        zigzag_unslice([torch.zeros(16)], [plan, plan.for_rank(1)])
    with pytest.raises(LayoutError, match=r"seq_len=0"):
        chunk_len(0, 2)
    with pytest.raises(LayoutError, match=r"context_len must be >= 1, got 0"):
        rank_token_budget(0, 2)
    with pytest.raises(LayoutError, match=r"num_scored=9 must be in \[0, seq_len-1=8\]"):
        scored_targets(9, 9, 2, 0)
    with pytest.raises(LayoutError, match=r"num_scored=-1"):
        scored_targets(9, -1, 2, 0)
    with pytest.raises(LayoutError, match=r"cp_rank must be in \[0, cp_size=2\), got 5"):
        scored_targets(9, 1, 2, 5)
    with pytest.raises(LayoutError, match=r"per-target vector has 3 entries, the datum scores 4"):
        scored_targets(9, 4, 2, 0).slice_targets(torch.zeros(3))


# ---------------------------------------------------------------------------------------------------------------
# 7. A pad-only row.


@pytest.mark.parametrize("cp_size", [1, 2, 3, 8])
def test_pad_only_row(cp_size):
    plans = all_plans((), cp_size, pad_to=128)
    for r, p in enumerate(plans):
        assert p.local_len == 128 and p.real_local_len == 0 and p.stream_pad_len == 128
        assert p.row_len == 0
        assert not bool(p.is_real.any())
        assert bool((p.row_index == PAD_INDEX).all())
        assert torch.equal(p.positions, torch.arange(128))
        assert torch.equal(p.global_index, torch.arange(r * 128, (r + 1) * 128))
        assert p.local_cu_seqlens.tolist() == [0, 128]
        local = zigzag_slice(torch.zeros(0, dtype=torch.int64), p, pad_value=5)
        assert local.shape == (128,) and bool((local == 5).all())
        wide = zigzag_slice(torch.zeros(2, 0, dtype=torch.float64), p, dim=1)
        assert wide.shape == (2, 128)
        assert zigzag_place(torch.ones(128), p).shape == (0,)
        part = contiguous_part(p)
        assert part.cu_seqlens.tolist() == [0, 128] and not part.continues
    parts = [zigzag_slice(torch.zeros(0), p) for p in plans]
    assert zigzag_unslice(parts, plans).shape == (0,)
    relayouts = [relayout_plan(p) for p in plans]
    for r, rp in enumerate(relayouts):
        assert rp.send_counts == tuple(128 if d == r else 0 for d in range(cp_size))
        assert torch.equal(rp.recv_index, torch.arange(128))
