"""The affine summary of a segment for chunkwise context parallelism: ``h_out = M · h_in + h_local``.

The gated delta recurrence is affine in the state: over a segment of tokens ``t = 1..L`` of one
sequence (per value head, the state a [Dk, Dv] matrix),

    h_out = M · h_in + h_local,   M = P_L ··· P_1 with P_t = α_t (I − β_t k_t k_tᵀ)   ([Dk, Dk]),
                                  h_local = the final state of the segment started from zero ([Dk, Dv]),

where ``·`` is the matrix product of [Dk, Dk] by [Dk, Dv] (``torch.einsum("nhij,nhjv->nhiv")``, see
:func:`apply_affine_summary`). ``M`` does not depend on v nor q. Because the chunked kernel is linear in
(state, values) jointly, one scan yields both: run it with values ``[v | 0]`` ([.., Dv + Dk]) from the
state ``[0 | I]``; the final state is ``[h_local | M]``.

Chunkwise CP recipe (for whoever builds it on these pieces): each rank summarises the segments of its
contiguous part (the first one may continue a sequence of the previous rank); the summaries of the
continuing segments are all-gathered and folded in rank order with :func:`compose_affine_summaries`
(a segment that starts a sequence has its incoming state zero, so only ``h_local`` matters there); each
rank then reruns :func:`chunk_gated_delta_rule` on its part with ``initial_state`` set to the incoming
state of its first segment (zeros for the others) to get its outputs. Keep ``M`` in float32 or better.
"""

from __future__ import annotations

import torch

from ringtune.ops.gated_delta.chunked import CHUNK_SIZE, chunk_scan_fn
from ringtune.ops.gated_delta.inputs import check_gated_delta_inputs, prepare_gated_delta_inputs


def gated_delta_affine_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool = False,
    chunk_size: int = CHUNK_SIZE,
    scan: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, h_local)`` of every segment of a packed row, so that ``final_state = M · initial_state + h_local``.

    Args:
        k: [T, Hk, Dk]; v: [T, Hv, Dv] (Hv a multiple of Hk); g, beta: [T, Hv], keyword-only;
        cu_seqlens: int64 [n+1] segment boundaries (empty segments give ``M = I``, ``h_local = 0``).
        use_qk_l2norm, chunk_size, scan: as :func:`chunk_gated_delta_rule` (pass the same ``use_qk_l2norm``).
    Returns:
        ``M`` [n, Hv, Dk, Dk] and ``h_local`` [n, Hv, Dk, Dv], float32 (float64 for float64 inputs), with
        ``chunk_gated_delta_rule(..., initial_state=h)[1] == apply_affine_summary(M, h_local, h)`` for any h.
        Differentiable by autograd.
    """
    bounds = check_gated_delta_inputs(None, k, v, g, beta, cu_seqlens, None)
    _, k, v, g, beta = prepare_gated_delta_inputs(None, k, v, g, beta, scale=None, use_qk_l2norm=use_qk_l2norm)
    T, H, Dk = k.shape
    Dv, n = v.shape[-1], len(bounds) - 1
    values = torch.cat([v, v.new_zeros(T, H, Dk)], dim=-1)
    eye = torch.eye(Dk, dtype=v.dtype, device=v.device).expand(n, H, Dk, Dk)
    start = torch.cat([v.new_zeros(n, H, Dk, Dv), eye], dim=-1)
    _, final = chunk_scan_fn(scan, k.device)(None, k, values, g, beta, bounds, start, chunk_size=chunk_size)
    assert final is not None
    return final[..., Dv:], final[..., :Dv]


def apply_affine_summary(M: torch.Tensor, h_local: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
    """``M · h_in + h_local``: [..., Dk, Dk] · [..., Dk, Dv] + [..., Dk, Dv] -> [..., Dk, Dv] (the outgoing state)."""
    return M @ h_in.to(M.dtype) + h_local


def compose_affine_summaries(
    first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summary of segment ``first`` followed by segment ``second`` (of the same sequence).

    ``(M1, h1)`` then ``(M2, h2)`` is ``(M2 · M1, M2 · h1 + h2)``; shapes as :func:`apply_affine_summary`.
    """
    (M1, h1), (M2, h2) = first, second
    return M2 @ M1, M2 @ h1 + h2
