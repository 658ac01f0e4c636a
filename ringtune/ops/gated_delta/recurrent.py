"""One-token GatedDeltaNet decode: the conv step and the recurrent rule step, for a batch of sequences.

Decoding advances B independent sequences by one token each. Per sequence the layer keeps

- the conv window: the K−1 raw (pre-conv) ``mixed_qkv`` inputs before the new token (zeros before the start),
- the recurrent state ``S`` [Hv, Dk, Dv] (float32, float64 for float64 inputs),

and one step is exactly one row of the packed ops: :func:`causal_conv1d_step` is one output row of
:func:`ringtune.ops.gated_delta.conv.causal_conv1d` with the window as its context, and
:func:`gated_delta_step` is one iteration of :func:`ringtune.ops.gated_delta.naive.naive_gated_delta_rule`,

    S ← α (S − β k (kᵀ S)) + β k vᵀ,    o = Sᵀ q · scale,    α = exp(g).

:func:`gated_delta_decode_core` chains them as :func:`ringtune.ops.gated_delta.core.gated_delta_core`
does for a packed row (conv → SiLU → split → L2-norm q, k → rule). No autograd is needed (sampling).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringtune.ops.gated_delta.core import pack_qkv, unpack_qkv
from ringtune.ops.gated_delta.inputs import compute_dtype, prepare_gated_delta_inputs


def causal_conv1d_step(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, *, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal depthwise conv step per sequence.

    Args:
        x: [B, channels], the new token's raw input of each sequence.
        window: [B, K−1, channels], the K−1 raw inputs before it (row K−2 is the latest; zeros before the start).
        weight: [channels, K] (``nn.Conv1d.weight`` squeezed); tap j multiplies the input ``K−1−j`` steps back.
        activation: "silu" or None.
    Returns:
        ``(out [B, channels] in x.dtype, new_window [B, K−1, channels] in x.dtype)``; computed in float32
        (float64 for float64 input), as :func:`causal_conv1d`.
    """
    B, D = x.shape
    K = weight.shape[1]
    if window.shape != (B, K - 1, D):
        raise ValueError(f"window must have shape [B, K-1, channels] = {[B, K - 1, D]}; got {tuple(window.shape)}")
    acc = compute_dtype(x.dtype)
    full = torch.cat([window.to(x.dtype), x[:, None]], dim=1)  # [B, K, D]
    out = (full.to(acc) * weight.to(acc).t()[None]).sum(dim=1)
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None; got {activation!r}")
    return out.to(x.dtype), full[:, 1:]


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for each of B sequences.

    Args:
        q, k: [B, Hk, Dk]; v: [B, Hv, Dv] (Hv a multiple of Hk: value head h reads key head ``h // (Hv/Hk)``).
        g: [B, Hv] log decay; beta: [B, Hv] write strength.
        state: [B, Hv, Dk, Dv], each sequence's state before this token (float32, float64 for float64 inputs).
        scale, use_qk_l2norm: as :func:`naive_gated_delta_rule`.
    Returns:
        ``(o [B, Hv, Dv] in q.dtype, new_state [B, Hv, Dk, Dv] in the compute dtype)``.
    """
    B, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != B or Hv % Hk:
        raise ValueError(f"q, k must be [B, Hk, Dk] and v [B, Hv, Dv]; got {tuple(q.shape)}, {tuple(v.shape)}")
    if g.shape != (B, Hv) or beta.shape != (B, Hv):
        raise ValueError(f"g and beta must be [B, Hv] = {[B, Hv]}; got {tuple(g.shape)}, {tuple(beta.shape)}")
    if state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"state must be [B, Hv, Dk, Dv] = {[B, Hv, Dk, Dv]}; got {tuple(state.shape)}")
    qa, ka, va, ga, ba = prepare_gated_delta_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    S = state.to(va.dtype)
    kt = ka.unsqueeze(-1)  # [B, H, Dk, 1]
    alpha, b = ga.exp()[..., None, None], ba[..., None, None]
    S = alpha * (S - b * kt @ (kt.transpose(-1, -2) @ S)) + b * kt @ va.unsqueeze(-2)
    o = (S.transpose(-1, -2) @ qa.unsqueeze(-1)).squeeze(-1)
    return o.to(q.dtype), S


def gated_delta_decode_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_window: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_core` for one new token of each of B sequences, from their conv windows and states.

    Args:
        q, k: [B, Hk, Dk]; v: [B, Hv, Dv], the raw (pre-conv) projections; g, beta: [B, Hv].
        conv_weight: [2·Hk·Dk + Hv·Dv, K]; conv_window: [B, K−1, channels] raw inputs (model dtype).
        state: [B, Hv, Dk, Dv] (float32, float64 for float64 inputs).
    Returns:
        ``(o [B, Hv, Dv] in q.dtype, new_window, new_state)``.
    """
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    mixed, window = causal_conv1d_step(pack_qkv(q, k, v), conv_window, conv_weight, activation="silu")
    qc, kc, vc = unpack_qkv(mixed, hk, dk, hv, dv)
    o, state = gated_delta_step(qc, kc, vc, g=g, beta=beta, state=state, scale=scale, use_qk_l2norm=True)
    return o, window, state
