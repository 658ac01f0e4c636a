"""The two normalisations of Qwen3.5's GatedDeltaNet: q/k L2 norm and the gated RMSNorm of the output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x², -1) + eps)`` over the last dim, as fla's ``l2norm`` (and transformers' ``l2norm``).

    Args:
        x: [..., D], any float dtype.
    Returns:
        [..., D] in ``x.dtype``, computed in float32 (float64 for float64 input). Differentiable.
    """
    xf = x.to(_acc(x.dtype))
    return (xf / torch.sqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of ``x`` times ``weight``, gated by ``silu(gate)``: transformers' ``Qwen3_5RMSNormGated``.

    ``out = (weight · (x · rsqrt(mean(x², -1) + eps)).to(x.dtype)) · silu(gate)``, with the norm and the
    gate computed in float32 (float64 for float64 input), exactly the rounding steps of transformers.
    The weight is used as is (initialised to ones), not as ``1 + weight`` like Qwen3.5's plain RMSNorm.

    Args:
        x: [..., D] (the per-head core output, e.g. [T, Hv, Dv]); gate: same shape (the ``z`` projection);
        weight: [D], shared by all heads.
    Returns:
        [..., D] in ``x.dtype``. Differentiable.
    """
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}; got {tuple(gate.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [D] = [{x.shape[-1]}]; got {tuple(weight.shape)}")
    acc = _acc(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out * F.silu(gate.to(acc))).to(x.dtype)
