"""Chunked gated delta rule over one packed THD row (WY representation / UT transform), plain torch.

Same contract as :func:`ringtune.ops.gated_delta.naive.naive_gated_delta_rule`. Each sequence is cut
into chunks of ``C`` tokens (its last chunk zero-padded: a pad has ``g = 0``, ``β = 0``, ``k = 0``, so
it leaves the state untouched). Inside a chunk, with ``G_i = Σ_{j≤i} g_j`` the cumulative log decay
and ``D_ij = exp(G_i − G_j)`` for ``j ≤ i`` (0 above the diagonal):

    A = strict_lower(diag(β) K Kᵀ ⊙ D),   T = (I + A)⁻¹                 (UT transform)
    U = T diag(β) V,                        W = T diag(β exp(G)) K        (WY pieces, [C, Dv] / [C, Dk])
    V' = U − W S                            (what the chunk writes, net of what S already predicts)
    O  = diag(exp(G)) Q S + (Q Kᵀ ⊙ D) V'
    S ← exp(G_C) S + (diag(exp(G_C − G)) K)ᵀ V'

so a chunk is the affine map ``S ↦ (exp(G_C) I − K̃ᵀ W) S + K̃ᵀ U`` with ``K̃ = diag(exp(G_C − G)) K``.
A, T, U, W and ``Q Kᵀ ⊙ D`` are computed for all chunks of the row at once; the lines that read the
incoming state (V', O, S) run in a scan with one step per chunk index, batched over every sequence
that still has a chunk there (sequences sorted by chunk count, so they are a prefix whose chunks
are contiguous rows): a row of many short documents takes few steps. Memory is O(T·C) per head for
the intra-chunk matrices plus one [Dk, Dv] state per chunk kept for the backward (as fla keeps
``h`` per chunk), never [T × T]. All exponents are ≤ 0: nothing overflows. A sequence shorter than
C still costs a full chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ringtune.ops.gated_delta.inputs import check_gated_delta_inputs, prepare_gated_delta_inputs

CHUNK_SIZE = 64


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = CHUNK_SIZE,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a packed row whose state resets at ``cu_seqlens``, chunk by chunk.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv], one float dtype (Hv a multiple of Hk: grouped value heads,
            value head ``h`` reads key head ``h // (Hv // Hk)``).
        cu_seqlens: int64 [n+1] sequence boundaries (0 first, T last; empty sequences allowed).
        g: [T, Hv] log decay (≤ 0), keyword-only; beta: [T, Hv] write strength in (0, 1), keyword-only.
        initial_state: [n, Hv, Dk, Dv], the state each sequence starts from (zeros if None).
        scale: multiplies q, default ``Dk ** -0.5``.
        use_qk_l2norm: L2-normalise q and k (in the compute dtype) first, as fla's ``use_qk_l2norm_in_kernel``.
        chunk_size: tokens per chunk (64 as fla and transformers).
        output_final_state: False returns None instead of the final states (saves [n, Hv, Dk, Dv] of memory,
            which for a row of many documents is large: the model's forward needs no state).
    Returns:
        ``(o [T, Hv, Dv] in q.dtype, final_state [n, Hv, Dk, Dv])``; computed and the state returned in float32
        (float64 for float64 inputs); ``final_state[i]`` is the state after the last token of sequence ``i``
        (``initial_state[i]`` for an empty one). Differentiable by autograd with respect to every tensor argument.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    bounds = check_gated_delta_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_gated_delta_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    o, final = gated_delta_chunk_scan(
        q, k, v, g, beta, bounds, initial_state, chunk_size=chunk_size, output_final_state=output_final_state
    )
    assert o is not None
    return o.to(out_dtype), final


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
    starts = torch.tensor([pairs[i][0] for i in order], dtype=torch.int64)
    ends = torch.tensor([pairs[i][1] for i in order], dtype=torch.int64)
    within = torch.arange(C, dtype=torch.int64)
    rows = [(starts[:a] + j * C).unsqueeze(1) + within for j, a in enumerate(active)]
    tok = torch.cat([torch.zeros(0, C, dtype=torch.int64), *rows])
    end = torch.cat([torch.zeros(0, dtype=torch.int64), *(ends[:a] for a in active)]).unsqueeze(1)
    offsets = list(itertools.accumulate([0, *active]))
    return ScanLayout(order=order, active=active, offsets=offsets, slot=torch.where(tok < end, tok, T).to(device))


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
    """The chunked kernel on prepared inputs (see :func:`prepare_gated_delta_inputs`), no checks.

    Args:
        q: [T, H, Dk] already scaled (or None: skip the outputs, return only the states); k: [T, H, Dk];
        v: [T, H, Dv]; g, beta: [T, H]; all one float dtype, heads already expanded (H = Hv).
        bounds: ``cu_seqlens`` as a list; initial_state: [n, H, Dk, Dv] or None (zeros).
        output_final_state: False skips assembling (and keeping) the final states.
    Returns:
        ``(o [T, H, Dv] or None, final_state [n, H, Dk, Dv] or None)`` in the dtype of ``v``.
    """
    T, H, Dk = k.shape
    Dv, dtype, device, C = v.shape[-1], v.dtype, v.device, chunk_size
    n = len(bounds) - 1
    layout = scan_layout(bounds, C, device)
    slot = layout.slot

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, C, ...] in scan order, pads zero
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[slot]
        return x.movedim(2, 1) if x.dim() == 4 else x.transpose(1, 2)

    kc, vc, gc, bc = chunked(k), chunked(v), chunked(g), chunked(beta)
    G = gc.cumsum(-1)  # [N, H, C]
    upper = torch.ones(C, C, dtype=torch.bool, device=device).triu(1)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # D, [N, H, C, C]
    k_beta = kc * bc.unsqueeze(-1)
    A = ((k_beta @ kc.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([vc * bc.unsqueeze(-1), k_beta * G.exp().unsqueeze(-1)], dim=-1)
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # (I + A)⁻¹ [βV | βexp(G)K]
    U, W = UW[..., :Dv], UW[..., Dv:]
    G_last = G[..., -1:]
    k_out = (kc * (G_last - G).exp().unsqueeze(-1)).transpose(-1, -2)  # K̃ᵀ: keys decayed to the chunk end
    gamma = G_last.exp().unsqueeze(-1)  # [N, H, 1, 1]
    if q is not None:
        qc = chunked(q)
        q_in = qc * G.exp().unsqueeze(-1)  # each query reads the incoming state decayed to its position
        qk = (qc @ kc.transpose(-1, -2)) * decay

    # The scan. Step j advances the sorted prefix that has a j-th chunk (a contiguous block of rows);
    # sequences whose last chunk it was drop out and their states are kept aside.
    # Each [N, ...] tensor is split ONCE into its per-step row blocks (views): the backward of a split is
    # one concatenation, whereas indexing the whole tensor at every step would make autograd allocate a
    # zero [N, ...] gradient per step and sum N/C of them (O(T²/C) memory traffic).
    steps = layout.active
    U_s, W_s, k_out_s, gamma_s = U.split(steps), W.split(steps), k_out.split(steps), gamma.split(steps)
    if q is not None:
        q_in_s, qk_s = q_in.split(steps), qk.split(steps)
    rank = torch.tensor(layout.order, dtype=torch.int64, device=device)
    S = None if initial_state is None else initial_state.to(dtype)[rank]  # None: zero state
    finished = []  # final states, sorted ranks [a_next, a) per step
    active = [*steps, 0]
    outs = []
    for j, a in enumerate(steps):
        S_a = None if S is None else S[:a]
        v_new = U_s[j] if S_a is None else U_s[j] - W_s[j] @ S_a
        if q is not None:
            outs.append(qk_s[j] @ v_new if S_a is None else q_in_s[j] @ S_a + qk_s[j] @ v_new)
        S = k_out_s[j] @ v_new if S_a is None else gamma_s[j] * S_a + k_out_s[j] @ v_new
        if output_final_state and active[j + 1] < a:
            finished.append(S[active[j + 1] :])
    o = None
    if q is not None:
        rows_out = torch.cat([v.new_zeros(0, H, C, Dv), *outs]).movedim(1, 2).reshape(-1, H, Dv)
        o = rows_out[torch.argsort(slot.flatten(), stable=True)[:T]]  # each token once; pads sort last
    if not output_final_state:
        return o, None
    empty = layout.active[0] if layout.active else 0  # sorted ranks [empty, n) have no token
    if initial_state is None:
        rest = v.new_zeros(n - empty, H, Dk, Dv)
    else:
        rest = initial_state.to(dtype)[rank[empty:]]
    final_sorted = torch.cat([*reversed(finished), rest])
    return o, final_sorted[torch.argsort(rank)]
