"""Qwen3.5's per-token decay and write strength from the ``a`` and ``b`` projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringtune.ops.gated_delta.inputs import compute_dtype


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = −exp(A_log) · softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, as transformers' Qwen3.5 GatedDeltaNet.

    Args:
        a, b: [T, Hv] (``in_proj_a`` / ``in_proj_b`` of the hidden states; any leading dims work).
        A_log, dt_bias: [Hv] parameters.
    Returns:
        ``(g, beta)``, both [T, Hv]. ``g`` (log decay, ≤ 0) is float32 (float64 when ``a`` is float64): transformers
        computes it from ``a.float()`` and ``A_log.float()`` so that a half-precision ``A_log`` cannot overflow;
        ``beta`` keeps ``b.dtype``. Differentiable.
    """
    Hv = a.shape[-1]
    if b.shape != a.shape:
        raise ValueError(f"b must have the shape of a {tuple(a.shape)}; got {tuple(b.shape)}")
    for name, p in (("A_log", A_log), ("dt_bias", dt_bias)):
        if p.shape != (Hv,):
            raise ValueError(f"{name} must have shape [Hv] = [{Hv}]; got {tuple(p.shape)}")
    acc = compute_dtype(a.dtype)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias)
    return g, b.sigmoid()
