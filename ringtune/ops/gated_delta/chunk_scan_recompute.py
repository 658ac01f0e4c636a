"""The chunked scan keeping only its inputs and segment start states; the backward recomputes segment by segment.

Same math and signature as :func:`ringtune.ops.gated_delta.chunk_scan.gated_delta_chunk_scan` (whose parts it
runs: :func:`chunk_pieces`, :func:`scan_steps`). Autograd would keep every intermediate of the scan (the
intra-chunk [C, C] matrices, the WY pieces U/W, a state per chunk: 19 KiB per token at 4 heads of 64 in
float32, 19× the benchmark model's layer input); this scan, like fla's kernels, keeps the inputs (3 KiB per
token there) and recomputes the rest in the backward (docs/gated_delta.md, benchmarks/gated_delta_memory.py).

**Segments.** The scan's chunks (:class:`ScanLayout`: step ``j`` advances the ``active[j]`` first sorted
sequences) are tiled into rectangles of (consecutive steps) × (consecutive sorted sequences): steps are
grouped greedily while the group holds at most ``segment_chunks`` chunks (at least one step per group), and
a single step holding more (a row of many short documents) is cut into blocks of ``segment_chunks``
sequences. Sequences are independent, so a rectangle needs only the states its sequences enter its first
step with: the **group start states** [active[j0], H, Dk, Dv], the only tensors the forward keeps besides
its inputs (none for the first group: the initial state, an input, or zeros).
``segment_chunks = max(1, segment_bytes // chunk_bytes)`` with ``chunk_bytes = H·C·(8C + 6·Dk + 8·Dv)·e``, an
estimate of what one chunk's recomputed forward holds (e the element size); :data:`SEGMENT_BYTES` = 32 MiB,
e.g. 22 chunks (1.4K tokens) at 4 heads of 64 in float32.

**Forward** (no autograd): the rectangles in scan order, each computing its pieces and steps from the
states of its sequences and writing its outputs into the [T, H, Dv] result.
**Backward**: the groups from the last to the first, carrying d(state) of the sequences that continue past
the group: each rectangle reruns its forward from its inputs and start states and back-propagates the
output gradient of its chunks and the state gradient at its exit (the carried one, or d(final state) for
sequences that end inside it) by hand (``chunk_scan_grad.py``: no autograd graph; 10 ms per 12-chunk
rectangle of the packed-8K benchmark where autograd through the rerun took 14); its start states' gradient is
what the previous group carries. Every rectangle reads and writes only its own rows (:func:`segment_chunks`
gathers them, pads masked to zero, with no padded copy of the row; :func:`put_tokens` writes outputs and
gradients into the preallocated [T, ...] results in place, every token once): the work and traffic are linear
in tokens, and the transient is one rectangle's intermediates and gradients. Exact: the same operations on the
same values as the whole-row scan, up to the order of floating-point sums inside batched products (< 1e-12 in
float64, see the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ringtune.ops.gated_delta.chunk_scan import CHUNK_SIZE, ScanLayout, chunk_pieces, scan_layout, scan_steps
from ringtune.ops.gated_delta.chunk_scan_grad import exit_state_gradient, segment_gradients

SEGMENT_BYTES = 32 * 2**20
"""Budget for the recomputed intermediates of one segment (rectangle of chunks), see the module docstring."""


def chunk_bytes(H: int, C: int, Dk: int, Dv: int, element_size: int) -> int:
    """Estimated bytes of one chunk's recomputed forward: ``H·C·(8C + 6·Dk + 8·Dv)·element_size``."""
    return H * C * (8 * C + 6 * Dk + 8 * Dv) * element_size


def segment_chunks_for(H: int, C: int, Dk: int, Dv: int, element_size: int, segment_bytes: int) -> int:
    """Chunks per segment: ``segment_bytes`` over :func:`chunk_bytes` (at least 1)."""
    return max(1, segment_bytes // chunk_bytes(H, C, Dk, Dv, element_size))


@dataclass(frozen=True)
class Segment:
    """One rectangle: steps ``j0 .. j0 + len(steps) − 1`` of sorted sequences ``lo .. lo + steps[0] − 1``.

    ``steps[i]`` is how many of them have a chunk at step ``j0 + i``; ``rows`` int64 [R] are those chunks'
    rows of ``ScanLayout.slot``, step by step (the order :func:`scan_steps` reads them in).
    """

    j0: int
    lo: int
    steps: list[int]
    rows: torch.Tensor


def tile_segments(layout: ScanLayout, segment_chunks: int) -> list[list[Segment]]:
    """The rectangles of every step group, groups in scan order (see the module docstring).

    The first rectangle of a group (``lo = 0``) spans all its steps: the group's next step is
    ``j0 + len(steps)`` of it.
    """
    active, offsets, J = layout.active, layout.offsets, len(layout.active)
    device = layout.slot.device
    groups, j0 = [], 0
    while j0 < J:
        j1, total = j0 + 1, active[j0]
        while j1 < J and total + active[j1] <= segment_chunks:
            total, j1 = total + active[j1], j1 + 1
        width = active[j0] if total <= segment_chunks else segment_chunks  # only a lone step can be too big
        blocks = []
        for lo in range(0, active[j0], width):
            steps = [c for c in (min(lo + width, a) - lo for a in active[j0:j1]) if c > 0]
            ranges = [torch.arange(offsets[j] + lo, offsets[j] + lo + c, device="cpu") for j, c in enumerate(steps, j0)]
            blocks.append(Segment(j0=j0, lo=lo, steps=steps, rows=torch.cat(ranges).to(device)))
        groups.append(blocks)
        j0 = j1
    return groups


def _continuing(layout: ScanLayout, blocks: list[Segment]) -> int:
    """How many sorted sequences have a chunk after the step group ``blocks``."""
    j1 = blocks[0].j0 + len(blocks[0].steps)
    return layout.active[j1] if j1 < len(layout.active) else 0


def segment_chunks(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The chunks of one segment: rows of ``x`` [T, H, ...] at ``slot`` [R, C] (pads: ``T``) -> [R, H, C, ...].

    Pads read zeros; only the segment's rows are read (no padded copy of ``x``). Not differentiable: the backward
    makes leaves of it.
    """
    rows = x.detach()[slot.clamp(max=x.shape[0] - 1)]  # [R, C, H, ...]
    pad = (slot == x.shape[0]).view(*slot.shape, *(1,) * (rows.dim() - 2))
    rows = rows.masked_fill(pad, 0)
    return rows.movedim(2, 1) if rows.dim() == 4 else rows.transpose(1, 2)


def put_tokens(out: torch.Tensor, chunked: torch.Tensor, slot: torch.Tensor) -> None:
    """Write chunked values [R, H, C, ...] at ``slot`` [R, C] into ``out`` [T, H, ...] in place, pads skipped."""
    rows = chunked.movedim(2, 1) if chunked.dim() == 4 else chunked.transpose(1, 2)  # [R, C, H, ...]
    real = slot < out.shape[0]
    out.index_copy_(0, slot[real], rows[real])


def recompute_scan_forward(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_sorted: torch.Tensor | None,
    layout: ScanLayout,
    groups: list[list[Segment]],
    *,
    output_final_state: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
    """The scan, segment by segment, without autograd.

    Args:
        q, k, v, g, beta: as :func:`recomputing_chunk_scan`; initial_sorted: [n, H, Dk, Dv] in sorted order
            (``initial_state[layout.order]``) or None (zeros); layout, groups: the row's scan layout and tiles.
    Returns:
        ``(o [T, H, Dv] or None, final states of the sequences with a chunk [active[0], H, Dk, Dv], sorted,
        or None, the start states [active[j0], H, Dk, Dv] of groups 1, 2, ...)``.
    """
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    o = None if q is None else v.new_empty(T, H, Dv)  # every token is in exactly one chunk
    S = initial_sorted
    starts: list[torch.Tensor] = []
    finished: list[torch.Tensor] = []
    for gi, blocks in enumerate(groups):
        if gi:
            assert S is not None  # the states that left group gi - 1
            starts.append(S)
        ends = []
        for seg in blocks:
            slot = layout.slot[seg.rows]
            qc = None if q is None else segment_chunks(q, slot)
            kc, vc, gc, bc = (segment_chunks(x, slot) for x in (k, v, g, beta))
            S_in = None if S is None else S[seg.lo : seg.lo + seg.steps[0]]
            outs, states = scan_steps(chunk_pieces(qc, kc, vc, gc, bc), seg.steps, S_in)
            assert states is not None  # keep_states and every segment has a step
            ends.append(states)
            if o is not None:
                put_tokens(o, torch.cat(outs), slot)
        exits = torch.cat(ends)  # [active[j0]]: each sequence's state after its last step in the group
        following = _continuing(layout, blocks)
        if output_final_state:
            finished.append(exits[following:])
        S = exits[:following]
    final = torch.cat([v.new_zeros(0, H, Dk, Dv), *finished[::-1]]) if output_final_state else None
    return o, final, starts


def recompute_scan_backward(
    inputs: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    initial_sorted: torch.Tensor | None,
    starts: list[torch.Tensor],
    layout: ScanLayout,
    groups: list[list[Segment]],
    d_o: torch.Tensor | None,
    d_final_sorted: torch.Tensor | None,
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """Gradients of the scan, the groups from the last to the first, each rectangle's by
    :func:`~ringtune.ops.gated_delta.chunk_scan_grad.segment_gradients` (a rerun of its forward, no graph).

    Args:
        inputs: ``(q or None, k, v, g, beta)`` as the forward got them; initial_sorted, layout, groups: as
            :func:`recompute_scan_forward`; starts: its group start states.
        d_o: [T, H, Dv] or None (zero); d_final_sorted: [n, H, Dk, Dv] in sorted order, or None (zero).
    Returns:
        ``([dq or None, dk, dv, dg, dbeta] each shaped as its input, d(initial_sorted[:active[0]]) or None
        when the first group starts from zeros)``.
    """
    H, Dk = inputs[1].shape[1:]
    like = inputs[2].new_zeros(0, H, Dk, inputs[2].shape[-1])  # a state's shape and dtype
    d_o = None if inputs[0] is None else d_o
    # every token is written once
    grads_in: list[torch.Tensor | None] = [None if x is None else torch.empty_like(x) for x in inputs]
    d_S = None  # d(state) of the sequences that leave the group being processed for the next one
    for gi in range(len(groups) - 1, -1, -1):
        blocks = groups[gi]
        start = initial_sorted if gi == 0 else starts[gi - 1]
        width = layout.active[blocks[0].j0]
        d_exit = exit_state_gradient(d_S, d_final_sorted, _continuing(layout, blocks), width, like)
        d_starts = []
        for seg in blocks:
            slot = layout.slot[seg.rows]
            qc = None if inputs[0] is None else segment_chunks(inputs[0], slot)
            kc, vc, gc, bc = (segment_chunks(x, slot) for x in inputs[1:])
            S_in = None if start is None else start[seg.lo : seg.lo + seg.steps[0]]
            d_outs = None if d_o is None else list(segment_chunks(d_o, slot).split(seg.steps))
            d_seg_exit = None if d_exit is None else d_exit[seg.lo : seg.lo + seg.steps[0]]
            *grads, d_start = segment_gradients(qc, kc, vc, gc, bc, seg.steps, S_in, d_outs, d_seg_exit)
            for out, grad in zip(grads_in, grads, strict=True):
                if out is not None and grad is not None:  # both None for an absent q
                    put_tokens(out, grad, slot)
            if d_start is not None:  # None exactly when the rectangle starts from zeros (S_in None)
                d_starts.append(d_start)
        d_S = torch.cat(d_starts) if d_starts else None
    return grads_in, d_S


class _RecomputingScan(torch.autograd.Function):
    """Thin autograd wrapper: :func:`recompute_scan_forward` / :func:`recompute_scan_backward`."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        bounds: list[int],
        chunk_size: int,
        segment_chunks: int,
        output_final_state: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        layout = scan_layout(bounds, chunk_size, v.device)
        groups = tile_segments(layout, segment_chunks)
        rank = torch.tensor(layout.order, dtype=torch.int64, device=v.device)
        initial_sorted = None if initial_state is None else initial_state[rank]
        o, final_sorted, starts = recompute_scan_forward(
            q, k, v, g, beta, initial_sorted, layout, groups, output_final_state=output_final_state
        )
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *starts)
        ctx.scan = (bounds, chunk_size, segment_chunks)
        ctx.set_materialize_grads(False)
        final = None
        if final_sorted is not None:
            n, empty = len(bounds) - 1, final_sorted.shape[0]  # sorted ranks [empty, n) have no token
            rest = v.new_zeros(n - empty, *final_sorted.shape[1:]) if initial_sorted is None else initial_sorted[empty:]
            final = torch.cat([final_sorted, rest])[torch.argsort(rank)]
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o: torch.Tensor | None, d_final: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, initial_state, *starts = ctx.saved_tensors
        bounds, chunk_size, segment_chunks = ctx.scan
        layout = scan_layout(bounds, chunk_size, v.device)
        groups = tile_segments(layout, segment_chunks)
        rank = torch.tensor(layout.order, dtype=torch.int64, device=v.device)
        initial_sorted = None if initial_state is None else initial_state[rank]
        d_final_sorted = None if d_final is None else d_final[rank]
        grads, d_active = recompute_scan_backward(
            (q, k, v, g, beta), initial_sorted, starts, layout, groups, d_o, d_final_sorted
        )
        d_initial = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            active = layout.active[0] if layout.active else 0
            head = initial_state.new_zeros(active, *initial_state.shape[1:]) if d_active is None else d_active
            tail = initial_state.new_zeros(len(rank) - active, *initial_state.shape[1:])
            tail = tail if d_final_sorted is None else d_final_sorted[active:]  # an empty sequence passes it on
            d_initial = torch.cat([head, tail])[torch.argsort(rank)]
        return (*grads, d_initial, None, None, None, None)


def recomputing_chunk_scan(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: list[int],
    initial_state: torch.Tensor | None,
    *,
    chunk_size: int = CHUNK_SIZE,
    output_final_state: bool = True,
    segment_bytes: int = SEGMENT_BYTES,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`~ringtune.ops.gated_delta.chunk_scan.gated_delta_chunk_scan`, keeping only inputs and segment states.

    Args:
        q: [T, H, Dk] already scaled, or None (states only); k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]; one
            float dtype, heads expanded (prepared by :func:`prepare_gated_delta_inputs`).
        bounds: ``cu_seqlens`` as a list; initial_state: [n, H, Dk, Dv] or None (zeros).
        output_final_state: False returns None for the final states.
        segment_bytes: the budget of one segment's recomputed intermediates (:data:`SEGMENT_BYTES`).
    Returns:
        ``(o [T, H, Dv] or None, final_state [n, H, Dk, Dv] or None)`` in the dtype of ``v``; differentiable
        once (no double backward) in q, k, v, g, beta and initial_state.
    """
    H, Dk = k.shape[1:]
    segment_chunks = segment_chunks_for(H, chunk_size, Dk, v.shape[-1], v.element_size(), segment_bytes)
    initial = None if initial_state is None else initial_state.to(v.dtype)
    return _RecomputingScan.apply(q, k, v, g, beta, initial, bounds, chunk_size, segment_chunks, output_final_state)
