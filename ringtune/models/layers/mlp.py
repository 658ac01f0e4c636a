"""The SwiGLU feed-forward block of every target model (per token: no communication under CP)."""

from __future__ import annotations

import torch
from torch import nn

from ringtune.models.layers.silu_mul import silu_mul
from ringtune.ops.linear import Linear


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) · up_proj(x))``; x [..., hidden] -> [..., hidden]. The activation is
    :func:`~ringtune.models.layers.silu_mul.silu_mul` (keeps gate and up, not the SiLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
