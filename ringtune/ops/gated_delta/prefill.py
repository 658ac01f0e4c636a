"""GatedDeltaNet prefill: the packed core of :func:`gated_delta_core`, plus what decoding continues from.

Decoding a sequence after its prompt needs, per GDN layer, the recurrent state after the prompt's last token
and the conv window (the last K−1 raw inputs). :func:`gated_delta_prefill` runs the same conv and chunked
rule as :func:`ringtune.ops.gated_delta.core.gated_delta_core` on a packed row, asks the chunked rule for its
final states, and cuts the windows out of the raw inputs.
"""

from __future__ import annotations

import itertools

import torch

from ringtune.ops.gated_delta.chunked import chunk_gated_delta_rule
from ringtune.ops.gated_delta.conv import causal_conv1d
from ringtune.ops.gated_delta.core import pack_qkv, unpack_qkv
from ringtune.ops.gated_delta.inputs import check_cu_seqlens


def last_inputs(x: torch.Tensor, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` rows of every sequence of a packed row, zeros in front of a shorter one.

    Args:
        x: [T, channels]; cu_seqlens: int64 [n+1]; width: K−1.
    Returns:
        [n, width, channels] in ``x.dtype``: row ``width−1`` is the sequence's last token (the conv window).
    """
    bounds = check_cu_seqlens(cu_seqlens, x.shape[0])
    n, D = len(bounds) - 1, x.shape[1]
    out = x.new_zeros(n, width, D)
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        take = min(width, end - start)
        if take:
            out[i, width - take :] = x[end - take : end]
    return out


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_core` of one packed row (states from zero), returning the states decoding needs.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv], raw (pre-conv) projections; g, beta: [T, Hv];
        cu_seqlens: int64 [n+1]; conv_weight: [2·Hk·Dk + Hv·Dv, K].
    Returns:
        ``(o [T, Hv, Dv] in q.dtype, final_state [n, Hv, Dk, Dv] float32 (float64 for float64),
        conv_window [n, K−1, channels] raw inputs in q.dtype)``; ``o`` is computed by the very calls of
        :func:`gated_delta_core` (only the final states are kept in addition).
    """
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    raw = pack_qkv(q, k, v)
    mixed = causal_conv1d(raw, conv_weight, cu_seqlens, activation="silu")
    qc, kc, vc = unpack_qkv(mixed, hk, dk, hv, dv)
    o, final = chunk_gated_delta_rule(
        qc, kc, vc, cu_seqlens, g=g, beta=beta, scale=scale, use_qk_l2norm=True, output_final_state=True
    )
    assert final is not None
    return o, final, last_inputs(raw, cu_seqlens, conv_weight.shape[1] - 1)
