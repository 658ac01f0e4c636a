"""The chunked scan of the gated delta rule (WY representation / UT transform) and its parts, plain torch.

Each sequence is cut into chunks of ``C`` tokens (its last chunk zero-padded: a pad has ``g = 0``,
``β = 0``, ``k = 0``, so it leaves the state untouched). Inside a chunk, with ``G_i = Σ_{j≤i} g_j`` the
cumulative log decay and ``D_ij = exp(G_i − G_j)`` for ``j ≤ i`` (0 above the diagonal):

    A = strict_lower(diag(β) K Kᵀ ⊙ D),   T = (I + A)⁻¹                 (UT transform)
    U = T diag(β) V,                        W = T diag(β exp(G)) K        (WY pieces, [C, Dv] / [C, Dk])
    V' = U − W S                            (what the chunk writes, net of what S already predicts)
    O  = diag(exp(G)) Q S + (Q Kᵀ ⊙ D) V'
    S ← exp(G_C) S + (diag(exp(G_C − G)) K)ᵀ V'

so a chunk is the affine map ``S ↦ (exp(G_C) I − K̃ᵀ W) S + K̃ᵀ U`` with ``K̃ = diag(exp(G_C − G)) K``.
:func:`chunk_pieces` computes A, T, U, W and ``Q Kᵀ ⊙ D`` for a batch of chunks at once; :func:`scan_steps`
runs the lines that read the incoming state (V', O, S) with one step per chunk index, batched over every
sequence that still has a chunk there (:class:`ScanLayout`: sequences sorted by chunk count, so they are a
prefix whose chunks are contiguous rows): a row of many short documents takes few steps. All exponents are
≤ 0: nothing overflows. A sequence shorter than C still costs a full chunk.

:func:`gated_delta_chunk_scan` is the whole row under autograd: it keeps every intermediate for the
backward (the intra-chunk [C, C] matrices, U, W, one state per chunk: O(T·C) per head, ≈ 25× the layer
input per token on the benchmark model, never [T × T]). ``chunk_scan_recompute.py`` runs the same parts
keeping only the inputs and a few states (see :data:`ringtune.ops.gated_delta.chunked.CHUNK_SCANS`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

CHUNK_SIZE = 64


@dataclass(frozen=True)
class ScanLayout:
    """Where every chunk of a packed row sits in the batched scan.

    Sequences are sorted by chunk count (descending, stable): ``order[r]`` is the sequence of sorted
    rank ``r``. Step ``j`` of the scan advances the ``active[j]`` first sorted sequences (those with a
    ``j``-th chunk), whose ``j``-th chunks are rows ``offsets[j] : offsets[j] + active[j]`` of ``slot``.
    ``slot`` [N, C] holds the token index of each chunk position, ``T`` for a pad.
    """

    order: list[int]
    active: list[int]
    offsets: list[int]
    slot: torch.Tensor


def scan_layout(bounds: list[int], chunk_size: int, device: torch.device) -> ScanLayout:
    """The :class:`ScanLayout` of a row with sequence boundaries ``bounds`` (``cu_seqlens`` as a list)."""
    C, T = chunk_size, bounds[-1]
    pairs = list(itertools.pairwise(bounds))
    counts = [-(-(end - start) // C) for start, end in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -counts[i])
    active, a = [], len(order)
    for j in range(counts[order[0]] if order else 0):
        while counts[order[a - 1]] <= j:
            a -= 1
        active.append(a)
    starts = torch.tensor([pairs[i][0] for i in order], dtype=torch.int64, device="cpu")
    ends = torch.tensor([pairs[i][1] for i in order], dtype=torch.int64, device="cpu")
    within = torch.arange(C, dtype=torch.int64, device="cpu")
    rows = [(starts[:a] + j * C).unsqueeze(1) + within for j, a in enumerate(active)]
    tok = torch.cat([torch.zeros(0, C, dtype=torch.int64, device="cpu"), *rows])
    end = torch.cat([torch.zeros(0, dtype=torch.int64, device="cpu"), *(ends[:a] for a in active)]).unsqueeze(1)
    offsets = list(itertools.accumulate([0, *active]))
    return ScanLayout(order=order, active=active, offsets=offsets, slot=torch.where(tok < end, tok, T).to(device))


def to_chunks(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [T + 1, H, ...] (last row zero: the pad) at ``slot`` [R, C] -> [R, H, C, ...]."""
    x = x[slot]
    return x.movedim(2, 1) if x.dim() == 4 else x.transpose(1, 2)


def from_chunks(x: torch.Tensor) -> torch.Tensor:
    """[R, H, C, D] -> [R·C, H, D], chunk positions in row order (the inverse of :func:`to_chunks`'s layout)."""
    return x.movedim(1, 2).reshape(-1, x.shape[1], x.shape[3])


def with_pad_row(x: torch.Tensor) -> torch.Tensor:
    """[T, H, ...] -> [T + 1, H, ...] with a zero last row, the value every pad slot reads."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


@dataclass(frozen=True)
class ChunkPieces:
    """The state-independent tensors of R chunks, [R, H, ...] (see the module docstring).

    ``U`` [R, H, C, Dv], ``W`` [R, H, C, Dk], ``k_out`` = K̃ᵀ [R, H, Dk, C], ``gamma`` = exp(G_C) [R, H, 1, 1];
    ``q_in`` = diag(exp(G)) Q [R, H, C, Dk] and ``qk`` = Q Kᵀ ⊙ D [R, H, C, C], or None without queries.
    """

    U: torch.Tensor
    W: torch.Tensor
    k_out: torch.Tensor
    gamma: torch.Tensor
    q_in: torch.Tensor | None
    qk: torch.Tensor | None


@dataclass(frozen=True)
class ChunkTerms:
    """:class:`ChunkPieces` with the intermediates the hand-written backward (``chunk_scan_grad.py``) reads.

    ``E`` = exp(G) and ``decay_to_end`` = exp(G_C − G) [R, H, C] (G the cumulative log decay);
    ``decay`` = D [R, H, C, C] (0 above the diagonal); ``kk`` = K Kᵀ
    and ``inverse`` = T = (I + A)⁻¹ [R, H, C, C]; ``UW`` = T [βV | β exp(G) K] [R, H, C, Dv + Dk]; ``qk_raw`` =
    Q Kᵀ [R, H, C, C] or None without queries.
    """

    pieces: ChunkPieces
    E: torch.Tensor
    decay_to_end: torch.Tensor
    decay: torch.Tensor
    kk: torch.Tensor
    inverse: torch.Tensor
    UW: torch.Tensor
    qk_raw: torch.Tensor | None


def chunk_terms(
    qc: torch.Tensor | None, kc: torch.Tensor, vc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor
) -> ChunkTerms:
    """:class:`ChunkTerms` of chunked inputs ``qc, kc`` [R, H, C, Dk] (or qc None), ``vc`` [R, H, C, Dv],
    ``gc, bc`` [R, H, C]; one float dtype. Each chunk only reads its own rows. Differentiable.

    T is formed explicitly (one triangular solve against I, then a product): on the packed-8K benchmark's
    [48, 64, 64] batches the solve against I and the product took 1.4 ms where the solve against
    [βV | βexp(G)K] took 1.8, and the backward then multiplies by Tᵀ instead of solving again.
    """
    C, Dv, device = kc.shape[2], vc.shape[-1], kc.device
    G = gc.cumsum(-1)  # [R, H, C]
    upper = torch.ones(C, C, dtype=torch.bool, device=device).triu(1)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # D, [R, H, C, C]
    kk = kc @ kc.transpose(-1, -2)
    A = (kk * decay * bc.unsqueeze(-1)).tril(-1)
    eye = torch.eye(C, dtype=A.dtype, device=device).expand(A.shape)
    inverse = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)  # T = (I + A)⁻¹
    E = G.exp()
    UW = inverse @ torch.cat([vc * bc.unsqueeze(-1), kc * (bc * E).unsqueeze(-1)], dim=-1)  # T [βV | βexp(G)K]
    G_last = G[..., -1:]
    decay_to_end = (G_last - G).exp()
    k_out = (kc * decay_to_end.unsqueeze(-1)).transpose(-1, -2)  # K̃ᵀ: keys decayed to the chunk end
    q_in = qk = qk_raw = None
    if qc is not None:
        q_in = qc * E.unsqueeze(-1)  # each query reads the incoming state decayed to its position
        qk_raw = qc @ kc.transpose(-1, -2)
        qk = qk_raw * decay
    pieces = ChunkPieces(UW[..., :Dv], UW[..., Dv:], k_out, G_last.exp().unsqueeze(-1), q_in, qk)
    return ChunkTerms(pieces, E, decay_to_end, decay, kk, inverse, UW, qk_raw)


def chunk_pieces(
    qc: torch.Tensor | None, kc: torch.Tensor, vc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor
) -> ChunkPieces:
    """:class:`ChunkPieces` of chunked inputs (as :func:`chunk_terms`). Differentiable."""
    return chunk_terms(qc, kc, vc, gc, bc).pieces


def scan_steps(
    pieces: ChunkPieces, steps: list[int], S: torch.Tensor | None, *, keep_states: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Advance sorted sequences through consecutive chunk indices; ``pieces`` holds their chunks step by step.

    Step ``j`` advances the ``steps[j]`` first sequences (``steps`` non-increasing, > 0), whose chunks are the
    next ``steps[j]`` rows of ``pieces``. ``S`` [steps[0], H, Dk, Dv] is their incoming state (None: zeros).
    Returns ``(outs, states)``: ``outs[j]`` [steps[j], H, C, Dv] the outputs of step j (empty list without
    queries) and ``states`` [steps[0], H, Dk, Dv], each sequence's state after its last step here (None if
    ``keep_states`` is False or there is no step).
    Each [R, ...] piece is split ONCE into its per-step row blocks (views): the backward of a split is one
    concatenation, whereas indexing the whole tensor at every step would make autograd allocate a zero
    [R, ...] gradient per step and sum R/C of them (O(T²/C) memory traffic).
    """
    q_in_s = qk_s = None
    if pieces.q_in is not None and pieces.qk is not None:
        q_in_s, qk_s = pieces.q_in.split(steps), pieces.qk.split(steps)
    outs, finished, following = [], [], [*steps[1:], 0]
    for step in state_steps(pieces, steps, S):
        j, a, S_a = step.index, steps[step.index], step.S_in
        if q_in_s is not None and qk_s is not None:
            outs.append(qk_s[j] @ step.v_new if S_a is None else q_in_s[j] @ S_a + qk_s[j] @ step.v_new)
        if keep_states and following[j] < a:
            finished.append(step.S_out[following[j] :])  # sequences whose last step here this was
    states = torch.cat(finished[::-1]) if keep_states and finished else None
    return outs, states


@dataclass(frozen=True)
class Step:
    """One step of the recurrence: ``index`` j, ``S_in`` the state entering it [steps[j], H, Dk, Dv] (None: zeros),
    ``v_new`` = V' = U − W S [steps[j], H, C, Dv], ``S_out`` = exp(G_C) S + K̃ᵀ V' (the state after it)."""

    index: int
    S_in: torch.Tensor | None
    v_new: torch.Tensor
    S_out: torch.Tensor


def state_steps(pieces: ChunkPieces, steps: list[int], S: torch.Tensor | None) -> Iterator[Step]:
    """The state recurrence of :func:`scan_steps` (same arguments), one :class:`Step` at a time: the one loop both
    the scan and the hand-written backward (``chunk_scan_grad.py``) run. Each piece is split once (see there)."""
    U_s, W_s, k_out_s, gamma_s = (x.split(steps) for x in (pieces.U, pieces.W, pieces.k_out, pieces.gamma))
    for j, a in enumerate(steps):
        S_a = None if S is None else S[:a]
        v_new = U_s[j] if S_a is None else U_s[j] - W_s[j] @ S_a
        S = k_out_s[j] @ v_new if S_a is None else gamma_s[j] * S_a + k_out_s[j] @ v_new
        yield Step(j, S_a, v_new, S)


def gated_delta_chunk_scan(
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
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The chunked kernel on prepared inputs (see :func:`prepare_gated_delta_inputs`), no checks; autograd keeps
    every intermediate.

    Args:
        q: [T, H, Dk] already scaled (or None: skip the outputs, return only the states); k: [T, H, Dk];
        v: [T, H, Dv]; g, beta: [T, H]; all one float dtype, heads already expanded (H = Hv).
        bounds: ``cu_seqlens`` as a list; initial_state: [n, H, Dk, Dv] or None (zeros).
        output_final_state: False skips assembling (and keeping) the final states.
    Returns:
        ``(o [T, H, Dv] or None, final_state [n, H, Dk, Dv] or None)`` in the dtype of ``v``.
    """
    T, H, Dk = k.shape
    Dv, dtype = v.shape[-1], v.dtype
    n = len(bounds) - 1
    layout = scan_layout(bounds, chunk_size, v.device)
    slot = layout.slot
    qc = None if q is None else to_chunks(with_pad_row(q), slot)
    chunks = (to_chunks(with_pad_row(x), slot) for x in (k, v, g, beta))
    pieces = chunk_pieces(qc, *chunks)
    rank = torch.tensor(layout.order, dtype=torch.int64, device=v.device)
    S = None if initial_state is None else initial_state.to(dtype)[rank]  # None: zero state
    outs, states = scan_steps(pieces, layout.active, S, keep_states=output_final_state) if layout.active else ([], None)
    o = None
    if q is not None:
        rows_out = from_chunks(torch.cat([v.new_zeros(0, H, chunk_size, Dv), *outs]))
        o = rows_out[torch.argsort(slot.flatten(), stable=True)[:T]]  # each token once; pads sort last
    if not output_final_state:
        return o, None
    empty = layout.active[0] if layout.active else 0  # sorted ranks [empty, n) have no token
    rest = v.new_zeros(n - empty, H, Dk, Dv) if initial_state is None else initial_state.to(dtype)[rank[empty:]]
    final_sorted = torch.cat([v.new_zeros(0, H, Dk, Dv) if states is None else states, rest])
    return o, final_sorted[torch.argsort(rank)]
