"""Qwen3.5's vision tower: image patches -> one embedding per decoder image token.

The same computation as transformers' ``Qwen3_5VisionModel`` (and the MoE family's, which is the same module),
with its parameter names (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,
mlp.linear_fc1,mlp.linear_fc2}``, ``merger.{norm,linear_fc1,linear_fc2}``), so ``model.visual.*`` loads and
saves with no renaming:

1. patch embedding: a Conv3d whose kernel is the whole ``temporal_patch_size × patch_size²`` patch;
2. a learned square grid of position embeddings, bilinearly resampled (corners aligned) to each image's
   ``h × w`` patch grid;
3. ``depth`` pre-norm blocks of bidirectional attention inside each frame of each image (2-D rotary on the
   patch's row and column) and a GELU MLP;
4. the merger: LayerNorm, then each ``m × m`` block of consecutive patches (the image processor emits
   patches in merge-block order) concatenated and projected to the decoder's hidden size.

Images never attend to each other, so encoding any subset of a row's images gives those images' embeddings
exactly: the CP rule of :mod:`ringtune.models.vision.placement` relies on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ringtune.models.vision.config import VisionConfig
from ringtune.ops.linear import Linear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def merge_block_coordinates(
    grid_thw: tuple[int, int, int], merge: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) int64 [t·h·w] on ``device`` of every patch of one image in the processor's order: frames, then
    ``m × m`` merge blocks in raster order, then the patches of a block in raster order."""
    t, h, w = grid_thw
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    rows, cols = rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)
    return rows.repeat(t), cols.repeat(t)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention inside each frame: ``qkv`` (fused, biased) and ``proj``."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        """x [P, hidden]; cos/sin [P, head_dim] in x's dtype; frames: consecutive runs of ``frame_lens`` patches."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        outs = []
        for qf, kf, vf in zip(q.split(frame_lens), k.split(frame_lens), v.split(frame_lens), strict=True):
            scores = torch.einsum("qhd,khd->hqk", qf, kf) * self.head_dim**-0.5
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf))
        return self.proj(torch.cat(outs).reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))`` with biases; act is tanh-approximated GELU (or exact)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = Linear(hidden_size, intermediate_size, bias=True)
        self.linear_fc2 = Linear(intermediate_size, hidden_size, bias=True)
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-norm residual block (LayerNorm eps 1e-6): attention, then the MLP."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_lens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """``proj``: Conv3d over one whole patch (kernel = stride = ``[temporal_patch_size, patch, patch]``)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, self.shape[1:], stride=self.shape[1:], bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, patch_dim] -> [P, hidden] in the weight's dtype."""
        x = pixel_values.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(x).view(x.shape[0], -1)


class PatchMerger(nn.Module):
    """``norm`` (LayerNorm over one patch), then ``m²`` patches concatenated -> ``linear_fc1`` -> GELU ->
    ``linear_fc2``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = Linear(self.merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


class VisionTower(nn.Module):
    """``model.visual``: images -> decoder-token embeddings. No communication; runs on one rank's images."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        spatial = config.head_dim // 2
        # A plain attribute (not a buffer): ``module.to(dtype)`` must not round the frequencies (float32, as HF).
        exponent = torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial
        self.inv_freq = 1.0 / (config.rope_theta**exponent)

    def _grid_terms(self, grids: Sequence[tuple[int, int, int]], device: torch.device):
        """Per patch of all images: bilinear taps into ``pos_embed`` [P, 4], their float32 weights [P, 4], and
        the float32 rotary angles [P, head_dim]."""
        side = int(self.config.num_position_embeddings**0.5)
        taps, weights, angles = [], [], []
        for grid in grids:
            rows, cols = merge_block_coordinates(grid, self.config.spatial_merge_size, self.inv_freq.device)
            axis = []
            for coord, size in ((rows, grid[1]), (cols, grid[2])):
                src = coord.to(torch.float32) * (side - 1) / max(size - 1, 1)  # corners aligned
                low = src.floor()
                near = torch.stack([low, low + 1], dim=1)
                axis.append((near.long().clamp(0, side - 1), (1 - (src[:, None] - near).abs()).clamp(min=0)))
            (h_tap, h_w), (w_tap, w_w) = axis
            taps.append((h_tap[:, :, None] * side + w_tap[:, None, :]).reshape(-1, 4))
            weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
            freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
            angles.append(torch.cat([freqs, freqs], dim=-1))
        return torch.cat(taps).to(device), torch.cat(weights).to(device), torch.cat(angles).to(device)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [sum t·h·w, patch_dim] (images back to back, as the processor emits them), grids the
        (t, h, w) of each -> embeddings [sum t·h·w / m², out_hidden_size] in the tower's dtype, image by image."""
        counts = [t * h * w for t, h, w in grids]
        if pixel_values.shape != (sum(counts), self.config.patch_dim):
            raise ValueError(
                f"pixel_values must be [{sum(counts)}, {self.config.patch_dim}] for grids {list(grids)}; "
                f"got {tuple(pixel_values.shape)}"
            )
        x = self.patch_embed(pixel_values)
        taps, weights, angles = self._grid_terms(grids, x.device)
        x = x + (self.pos_embed(taps) * weights[:, :, None]).sum(1).to(x.dtype)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        frame_lens = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frame_lens)
        return self.merger(x)
