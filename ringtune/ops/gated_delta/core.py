"""The sequence-mixing core of a GatedDeltaNet layer over one packed row, single process.

``conv -> SiLU -> split q/k/v -> L2-norm q, k -> gated delta rule``: everything between the input
projections and the output norm. This is the reference the CP modes are compared with, and the
kernel the headwise mode runs on its head shard.

Channel layout of the conv (Qwen3.5's ``mixed_qkv``): ``[q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]``,
head-major inside each part; ``conv_weight`` is [channels, K] (depthwise, no bias).
"""

from __future__ import annotations

import torch

from ringtune.ops.gated_delta.chunked import chunk_gated_delta_rule
from ringtune.ops.gated_delta.conv import causal_conv1d


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv] -> [T, 2·Hk·Dk + Hv·Dv] in the conv's channel layout."""
    T = q.shape[0]
    return torch.cat([x.reshape(T, x.shape[1] * x.shape[2]) for x in (q, k, v)], dim=1)


def unpack_qkv(mixed: torch.Tensor, hk: int, dk: int, hv: int, dv: int):
    """Inverse of :func:`pack_qkv`."""
    T = mixed.shape[0]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=1)
    return q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv)


def gated_delta_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    scale: float | None = None,
    conv_context: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scan: str | None = None,
) -> torch.Tensor:
    """GDN core of one packed row (full, or one contiguous part); state and conv reset at ``cu_seqlens``.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv], the raw (pre-conv) projections; g, beta: [T, Hv].
        conv_weight: [2·Hk·Dk + Hv·Dv, K].
        conv_context: [n, K-1, channels] raw inputs that precede each segment (the CP conv halo), or None.
        initial_state: [n, Hv, Dk, Dv] state each segment starts from, or None (zeros).
        scan: the chunked scan by name (``ringtune.ops.gated_delta.chunked.CHUNK_SCANS``; same values), None: the
            device's default.
    Returns:
        o [T, Hv, Dv] in the input dtype. Differentiable in every tensor argument.
    """
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    mixed = causal_conv1d(pack_qkv(q, k, v), conv_weight, cu_seqlens, activation="silu", initial_context=conv_context)
    qc, kc, vc = unpack_qkv(mixed, hk, dk, hv, dv)
    o, _ = chunk_gated_delta_rule(
        qc,
        kc,
        vc,
        cu_seqlens,
        g=g,
        beta=beta,
        initial_state=initial_state,
        scale=scale,
        use_qk_l2norm=True,
        output_final_state=False,
        scan=scan,
    )
    return o
