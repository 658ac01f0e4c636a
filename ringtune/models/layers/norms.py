"""RMSNorm in the two weight conventions of the target models (both normalise in float32, fp64 for fp64)."""

from __future__ import annotations

import torch
from torch import nn


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """RMSNorm over the last dim.

    ``zero_centered=False`` (Llama, Qwen3): ``weight · normed.to(dtype)``, weight initialised to ones.
    ``zero_centered=True`` (Qwen3.5): ``(normed · (1 + weight)).to(dtype)``, weight initialised to zeros.
    These are exactly the rounding steps of the transformers modules, so checkpoints load as they are.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim] in ``x.dtype``."""
        xf = x.to(_acc(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.to(xf.dtype))).to(x.dtype)
        return self.weight * normed.to(x.dtype)
