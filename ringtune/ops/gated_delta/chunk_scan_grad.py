"""The hand-written backward of one rectangle of the chunked scan: :func:`chunk_terms` + :func:`scan_steps`.

The recomputing scan (``chunk_scan_recompute.py``) reruns each rectangle in its backward; this module gives the
rectangle's gradients from the rerun's values directly, without building an autograd graph. With the notation
of ``chunk_scan.py`` (per chunk and head; D the decay, T = (I + A)⁻¹, K̃ = diag(exp(G_C − G)) K), a step is
``V' = U − W S``, ``O = Q_in S + (QKᵀ ⊙ D) V'``, ``S' = exp(G_C) S + K̃ᵀ V'``, so, from the last step back
(``dS'`` the gradient reaching the step's exit state):

    dV' = (QKᵀ ⊙ D)ᵀ dO + K̃ dS'           dU = dV'          dW = −dV' Sᵀ
    d(QKᵀ ⊙ D) = dO V'ᵀ   dQ_in = dO Sᵀ   dK̃ = V' dS'ᵀ      d exp(G_C) = Σ dS' ⊙ S
    dS = exp(G_C) dS' + Q_inᵀ dO − Wᵀ dV'

and then, for all the rectangle's chunks at once, through the pieces: ``[dβV | dβexp(G)K] = Tᵀ [dU | dW]`` and
``dA = −strict_lower([dβV | dβexp(G)K] [U | W]ᵀ)`` (the gradient of a unit lower triangular solve), the
element-wise products, ``dG`` from D (``X = dD ⊙ D``: row sums minus column sums), from exp(G), exp(G_C − G)
and exp(G_C), and ``dg`` = the reversed cumulative sum of ``dG``. It is the same arithmetic autograd runs on the
same values, up to the order of floating-point sums (< 1e-13 in float64: ``tests/test_gated_delta_recompute.py``).
"""

from __future__ import annotations

import itertools

import torch

from ringtune.ops.gated_delta.chunk_scan import ChunkTerms, chunk_terms, state_steps

_Grads = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def segment_gradients(
    qc: torch.Tensor | None,
    kc: torch.Tensor,
    vc: torch.Tensor,
    gc: torch.Tensor,
    bc: torch.Tensor,
    steps: list[int],
    S0: torch.Tensor | None,
    d_outs: list[torch.Tensor] | None,
    d_exit: torch.Tensor | None,
) -> _Grads:
    """Gradients of ``scan_steps(chunk_pieces(qc, kc, vc, gc, bc), steps, S0)`` (keeping states) in its inputs.

    Args:
        qc, kc: [R, H, C, Dk] (qc None: no outputs); vc: [R, H, C, Dv]; gc, bc: [R, H, C]; one float dtype,
            R = sum(steps) chunks in step order (as :func:`scan_steps` reads them).
        steps: non-increasing active counts (> 0); S0: [steps[0], H, Dk, Dv] or None (zeros, no gradient).
        d_outs: per step [steps[j], H, C, Dv], the gradient of each step's outputs, or None (zero).
        d_exit: [steps[0], H, Dk, Dv], the gradient of each sequence's state after its last step here, or None.
    Returns:
        ``(dq or None, dk, dv, dg, dbeta, dS0 or None)``, shaped as the inputs (dS0 None when S0 is None).
    """
    with torch.no_grad():
        terms = chunk_terms(qc, kc, vc, gc, bc)
        entering, v_new = _states(terms, steps, S0)
        d_pieces, d_S0 = _steps_backward(terms, steps, entering, v_new, d_outs, d_exit)
        return (*_pieces_backward(qc, kc, vc, bc, terms, d_pieces), d_S0)


def _states(
    terms: ChunkTerms, steps: list[int], S0: torch.Tensor | None
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """The state entering each step (None: a first step from zeros) and each step's V' [steps[j], H, C, Dv]."""
    entering: list[torch.Tensor | None] = []
    v_new: list[torch.Tensor] = []
    for step in state_steps(terms.pieces, steps, S0):
        entering.append(step.S_in)
        v_new.append(step.v_new)
    return entering, v_new


def exit_state_gradient(
    d_carried: torch.Tensor | None, d_final_sorted: torch.Tensor | None, following: int, width: int, like: torch.Tensor
) -> torch.Tensor | None:
    """d(state) of the ``width`` first sorted sequences after a step or a step group: ``d_carried`` for the
    ``following`` that go on, ``d_final_sorted[following:width]`` for those that end there; None when both are
    None (zero). ``like``: a [0, H, Dk, Dv] tensor of the state's shape and dtype."""
    if d_carried is None and d_final_sorted is None:
        return None
    shape = like.shape[1:]
    carried = like.new_zeros(following, *shape) if d_carried is None else d_carried
    ending = like.new_zeros(width - following, *shape) if d_final_sorted is None else d_final_sorted[following:width]
    return torch.cat([carried, ending])


class _PieceGrads:
    """Gradients of a rectangle's pieces, [R, H, ...] buffers written step by step (rows of step j: a slice).

    ``UW`` [R, H, C, Dv + Dk] = [dU | dW]; ``k_tilde`` = dK̃ [R, H, C, Dk]; ``gamma`` [R, H, 1, 1];
    ``q_in`` [R, H, C, Dk] and ``qk`` [R, H, C, C] (None without outputs to differentiate).
    """

    def __init__(self, terms: ChunkTerms, with_outputs: bool) -> None:
        p = terms.pieces
        self.UW = torch.empty_like(terms.UW)
        self.k_tilde = torch.empty_like(p.k_out.transpose(-1, -2))
        self.gamma = torch.empty_like(p.gamma)
        self.q_in = torch.empty_like(p.q_in) if with_outputs and p.q_in is not None else None
        self.qk = torch.empty_like(p.qk) if with_outputs and p.qk is not None else None


def _steps_backward(
    terms: ChunkTerms,
    steps: list[int],
    entering: list[torch.Tensor | None],
    v_new: list[torch.Tensor],
    d_outs: list[torch.Tensor] | None,
    d_exit: torch.Tensor | None,
) -> tuple[_PieceGrads, torch.Tensor | None]:
    """The steps from the last to the first (module docstring); returns the pieces' gradients and dS0."""
    p, Dv = terms.pieces, terms.pieces.U.shape[-1]
    grads = _PieceGrads(terms, d_outs is not None)
    W_s, k_out_s, gamma_s = (x.split(steps) for x in (p.W, p.k_out, p.gamma))
    q_in_s = None if grads.q_in is None or p.q_in is None else p.q_in.split(steps)
    qk_s = None if grads.qk is None or p.qk is None else p.qk.split(steps)
    offsets = list(itertools.accumulate(steps, initial=0))
    like = p.W.new_zeros(0, p.W.shape[1], p.W.shape[-1], Dv)  # a state's shape and dtype
    d_S = None  # the gradient of the state entering the step after j, for its active sequences
    for j in range(len(steps) - 1, -1, -1):
        a, following = steps[j], steps[j + 1] if j + 1 < len(steps) else 0
        rows = slice(offsets[j], offsets[j + 1])
        d_state = exit_state_gradient(d_S, d_exit, following, a, like)  # dS' of step j
        d_o = None if d_outs is None else d_outs[j]
        S_a, v = entering[j], v_new[j]
        dv = grads.UW[rows, ..., :Dv]
        if d_o is not None and qk_s is not None and grads.qk is not None:
            torch.matmul(qk_s[j].transpose(-1, -2), d_o, out=dv)
            torch.matmul(d_o, v.transpose(-1, -2), out=grads.qk[rows])
            if d_state is not None:
                dv.add_(k_out_s[j].transpose(-1, -2) @ d_state)
        elif d_state is not None:
            torch.matmul(k_out_s[j].transpose(-1, -2), d_state, out=dv)
        else:
            dv.zero_()
        if d_state is not None:
            torch.matmul(v, d_state.transpose(-1, -2), out=grads.k_tilde[rows])  # dK̃ = V' dS'ᵀ
        else:
            grads.k_tilde[rows].zero_()
        if S_a is None:  # a first step from zeros: no W S, Q_in S or exp(G_C) S term
            grads.UW[rows, ..., Dv:].zero_()
            grads.gamma[rows].zero_()
            if grads.q_in is not None:
                grads.q_in[rows].zero_()
            d_S = None
            continue
        torch.matmul(dv, S_a.transpose(-1, -2), out=grads.UW[rows, ..., Dv:]).neg_()  # dW = −dV' Sᵀ
        d_S = -(W_s[j].transpose(-1, -2) @ dv)
        if grads.q_in is not None and q_in_s is not None and d_o is not None:
            torch.matmul(d_o, S_a.transpose(-1, -2), out=grads.q_in[rows])
            d_S += q_in_s[j].transpose(-1, -2) @ d_o
        if d_state is not None:
            torch.sum(d_state * S_a, dim=(-1, -2), keepdim=True, out=grads.gamma[rows])
            d_S += gamma_s[j] * d_state
        else:
            grads.gamma[rows].zero_()
    return grads, d_S


def _pieces_backward(
    qc: torch.Tensor | None,
    kc: torch.Tensor,
    vc: torch.Tensor,
    bc: torch.Tensor,
    terms: ChunkTerms,
    grads: _PieceGrads,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the pieces' gradients to ``(dq or None, dk, dv, dg, dbeta)``, all chunks at once."""
    Dv = vc.shape[-1]
    D, E, decay_to_end = terms.decay, terms.E, terms.decay_to_end
    d_rhs = terms.inverse.transpose(-1, -2) @ grads.UW  # [dβV | dβexp(G)K]
    dA = (d_rhs @ terms.UW.transpose(-1, -2)).tril_(-1).neg_()
    d_bv, d_bek = d_rhs[..., :Dv], d_rhs[..., Dv:]
    b = bc.unsqueeze(-1)
    dv = d_bv * b
    d_bE = (d_bek * kc).sum(-1)  # d(β exp(G))
    dk = d_bek * (bc * E).unsqueeze(-1)
    dA_D = dA * D
    d_kk = dA_D * b  # A = strict_lower(β_i · KKᵀ ⊙ D)
    X = d_kk * terms.kk  # dD ⊙ D, from A
    db = (d_bv * vc).sum(-1) + d_bE * E + (dA_D * terms.kk).sum(-1)
    dE = d_bE * bc
    dq = None if qc is None else torch.zeros_like(qc)  # no output gradient: q has none
    if qc is not None and grads.qk is not None and grads.q_in is not None and terms.qk_raw is not None:
        d_qk_raw = grads.qk * D
        X = X + d_qk_raw * terms.qk_raw
        dq = d_qk_raw @ kc + grads.q_in * E.unsqueeze(-1)
        dk = dk + d_qk_raw.transpose(-1, -2) @ qc
        dE = dE + (grads.q_in * qc).sum(-1)
    dk = dk + (d_kk + d_kk.transpose(-1, -2)) @ kc + grads.k_tilde * decay_to_end.unsqueeze(-1)
    d_decay_to_end = (grads.k_tilde * kc).sum(-1) * decay_to_end
    dG = X.sum(-1) - X.sum(-2) + dE * E - d_decay_to_end
    dG[..., -1] += d_decay_to_end.sum(-1) + grads.gamma.flatten(-3) * terms.pieces.gamma.flatten(-3)
    dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g)
    return dq, dk, dv, dg, db
