"""Plain per-token reference of the gated delta rule over one packed THD row: the oracle of the tests.

Per value head, with ``α_t = exp(g_t)`` and the state ``S`` a [Dk, Dv] matrix:

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t · scale,

restarting from ``initial_state[i]`` (zeros by default) at the start of every sequence ``i`` of
``cu_seqlens``. One Python step per token: for short rows only.
"""

from __future__ import annotations

import itertools

import torch

from ringtune.ops.gated_delta.inputs import check_gated_delta_inputs, prepare_gated_delta_inputs


def naive_gated_delta_rule(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, over a packed row whose state resets at ``cu_seqlens``.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv], one float dtype (Hv a multiple of Hk: grouped value heads,
            value head ``h`` reads key head ``h // (Hv // Hk)``).
        cu_seqlens: int64 [n+1] sequence boundaries (0 first, T last; empty sequences allowed).
        g: [T, Hv] log decay (≤ 0), keyword-only; beta: [T, Hv] write strength in (0, 1), keyword-only.
        initial_state: [n, Hv, Dk, Dv], the state each sequence starts from (zeros if None).
        scale: multiplies q, default ``Dk ** -0.5``.
        use_qk_l2norm: L2-normalise q and k (in the compute dtype) first, as fla's ``use_qk_l2norm_in_kernel``.
    Returns:
        ``(o [T, Hv, Dv] in q.dtype, final_state [n, Hv, Dk, Dv])``; computed and the state returned in float32
        (float64 for float64 inputs). Differentiable by autograd with respect to every tensor argument.
    """
    bounds = check_gated_delta_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_gated_delta_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    _T, H, Dk = k.shape
    Dv = v.shape[-1]
    alpha = g.exp()
    outs, finals = [], []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if initial_state is None:
            S = v.new_zeros(H, Dk, Dv)
        else:
            S = initial_state[i].to(v.dtype)
        for t in range(start, end):
            kt = k[t].unsqueeze(-1)  # [H, Dk, 1]
            a_t, b_t = alpha[t].view(H, 1, 1), beta[t].view(H, 1, 1)
            S = a_t * (S - b_t * kt @ (kt.transpose(-1, -2) @ S)) + b_t * kt @ v[t].unsqueeze(-2)
            outs.append((S.transpose(-1, -2) @ q[t].unsqueeze(-1)).squeeze(-1))  # [H, Dv]
        finals.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, H, Dv)
    final = torch.stack(finals) if finals else v.new_zeros(0, H, Dk, Dv)
    return o.to(out_dtype), final
