"""Rotary position embedding on explicit per-token positions (full or partial rotary, rotate-half layout).

Qwen3.5's MRoPE gives every token three positions (temporal, height, width; :mod:`ringtune.layout.mrope`) and
interleaves them over the frequencies: frequency ``i`` takes the height position when ``i % 3 == 1`` and
``i < 3·mrope_section[1]``, the width position when ``i % 3 == 2`` and ``i < 3·mrope_section[2]``, the temporal
one otherwise (transformers' ``Qwen3_5TextRotaryEmbedding``). A text token has three equal positions, so plain
rotary over the first ``rotary_dim`` channels is the same thing: one implementation serves Llama, Qwen3 and
Qwen3.5 text (positions [T]) and Qwen3.5 with images (positions [3, T]).
cos/sin are computed in float32 (as transformers does, even for a float64 model) and cast to the input dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from ringtune.errors import UserInputError


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``positions``; no learnable state (``inv_freq`` float32, never cast)."""

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float,
        partial_rotary_factor: float = 1.0,
        mrope_section: tuple[int, int, int] = (11, 11, 10),
    ) -> None:
        super().__init__()
        self.mrope_section = tuple(mrope_section)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise UserInputError(
                f"rotary_dim = head_dim·partial_rotary_factor = {head_dim}·{partial_rotary_factor} = "
                f"{self.rotary_dim} must be even and in (0, head_dim={head_dim}]"
            )
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu").float() / self.rotary_dim
        # A plain attribute, not a buffer: ``module.to(bfloat16)`` must not round the frequencies.
        self.inv_freq = 1.0 / (theta**exponent)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] (text) or [3, T] (MRoPE rows t, h, w) -> (cos, sin), each [T, rotary_dim] in
        ``dtype``."""
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() == 2:  # MRoPE: the frequencies of each axis, interleaved
            per_axis = positions.to(torch.float32)[:, :, None] * inv_freq[None, None, :]
            freqs = per_axis[0].clone()
            for axis in (1, 2):
                picked = slice(axis, 3 * self.mrope_section[axis], 3)
                freqs[:, picked] = per_axis[axis][:, picked]
        else:
            freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated on its first ``rotary_dim = cos.shape[-1]`` channels; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)
