"""Which images a CP rank encodes and where their embeddings go: :class:`ShardImages`.

The rule (docs/models.md, "Images under DP × CP"): a rank encodes, whole, every image of the row of which
its zigzag shard holds at least one token, and keeps the embeddings of its own tokens only. An image whose
tokens straddle two ranks' chunks is encoded on both (the tower is per image: the same embeddings on each),
but each embedding row feeds exactly one rank's decoder, so the vision gradients of the ranks are disjoint
parts of the whole row's and SUM over the CP group to it, as every replicated parameter's do. No collective;
the redundant work is at most the images that straddle a chunk boundary (two per sequence and rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringtune.layout.mrope import ImageSpan
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.models.image_input import ImageInput


@dataclass(frozen=True, kw_only=True)
class ShardImages:
    """This rank's images of one packed row.

    Attributes:
        spans: every image of the row, per sequence, as ``(token_start, grid_thw)`` in sequence coordinates
            (all ranks hold the same): the MRoPE positions are built from them (:mod:`ringtune.layout.mrope`).
        spatial_merge_size: the tower's ``m``.
        pixel_values: float32 [sum t·h·w, patch_dim], the images this rank encodes, back to back (may be empty).
        grids: their ``(t, h, w)``.
        local_index: int64 [n]: the local tokens (indices into this rank's stream) that are image tokens.
        embed_index: int64 [n]: for each, its row in the tower's output for ``pixel_values``.
    """

    spans: tuple[tuple[ImageSpan, ...], ...]
    spatial_merge_size: int
    pixel_values: torch.Tensor
    grids: tuple[tuple[int, int, int], ...]
    local_index: torch.Tensor
    embed_index: torch.Tensor

    def to(self, device: torch.device | str) -> ShardImages:
        """The same on ``device`` (pixels and indices)."""
        return ShardImages(
            spans=self.spans,
            spatial_merge_size=self.spatial_merge_size,
            pixel_values=self.pixel_values.to(device),
            grids=self.grids,
            local_index=self.local_index.to(device),
            embed_index=self.embed_index.to(device),
        )


def _grid(image: ImageInput) -> tuple[int, int, int]:
    """``image.grid_thw`` as a tuple of three ints (a list or tensor from a caller is read the same)."""
    t, h, w = image.grid_thw
    return int(t), int(h), int(w)


def shard_images(plan: ZigzagPlan, images: Sequence[Sequence[ImageInput]], spatial_merge_size: int) -> ShardImages:
    """The :class:`ShardImages` of ``plan``'s rank for a row whose sequence ``i`` carries ``images[i]`` (token
    order, ``token_start`` relative to the sequence). Pure index work on the host."""
    if len(images) != len(plan.seq_lens):
        raise ValueError(f"images: {len(images)} lists for the row's {len(plan.seq_lens)} sequences")
    row_index = plan.row_index
    pixels: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    local: list[torch.Tensor] = []
    embed: list[torch.Tensor] = []
    offset = 0
    for row_start, seq_images in zip(plan.row_starts, images, strict=True):
        for image in seq_images:
            start = row_start + image.token_start
            held = ((row_index >= start) & (row_index < start + image.num_tokens)).nonzero().squeeze(1)
            if held.numel() == 0:
                continue
            pixels.append(image.pixel_values.to(torch.float32))
            grids.append(_grid(image))
            local.append(held)
            embed.append(offset + row_index[held] - start)
            offset += image.num_tokens
    width = images_width(images)
    return ShardImages(
        spans=tuple(tuple((im.token_start, _grid(im)) for im in seq) for seq in images),
        spatial_merge_size=spatial_merge_size,
        pixel_values=torch.cat([torch.zeros(0, width, device="cpu"), *pixels]),
        grids=tuple(grids),
        local_index=torch.cat([torch.zeros(0, dtype=torch.int64, device="cpu"), *local]),
        embed_index=torch.cat([torch.zeros(0, dtype=torch.int64, device="cpu"), *embed]),
    )


def images_width(images: Sequence[Sequence[ImageInput]]) -> int:
    """The ``patch_dim`` of the row's images (0 when it has none)."""
    for seq in images:
        for image in seq:
            return int(image.pixel_values.shape[1])
    return 0
