"""Multimodal rotary positions (MRoPE) of packed rows: built per whole sequence, then zigzag-sliced.

Pure index math (int64 torch tensors, no torch.distributed). Qwen3.5's rule (transformers'
``Qwen3_5Model.get_rope_index``) gives every token three positions (temporal, height, width):

- a text token continues the running position ``p`` on all three rows (``p, p, p``), then ``p += 1``;
- an image of patch grid ``(t, h, w)`` merged by ``m`` (``spatial_merge_size``) occupies
  ``t·(h/m)·(w/m)`` tokens in (t, h, w) raster order; the token at ``(i, j, k)`` gets
  ``(p + i, p + j, p + k)``; afterwards ``p += max(h, w) / m``.

A sequence's positions depend on everything before each token, so they are built on the whole sequence
(:func:`sequence_mrope_positions`) and then sliced to a CP rank's zigzag chunks like every other per-token
input (:func:`shard_mrope_positions`). Numbering a rank's chunks as if they were one sequence gives wrong
positions that nothing downstream would notice; :func:`check_shard_mrope_positions` is the run-time guard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringtune.errors import LayoutError, ParallelConfigError
from ringtune.layout.zigzag import ZigzagPlan

ImageSpan = tuple[int, tuple[int, int, int]]
"""``(token_start, (t, h, w))``: where an image's pad tokens start in its sequence, and its patch grid."""


def image_token_count(grid_thw: tuple[int, int, int], spatial_merge_size: int) -> int:
    """Tokens an image of patch grid ``(t, h, w)`` occupies: ``t·h·w / m²`` (h, w multiples of ``m``)."""
    t, h, w = grid_thw
    m = spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise LayoutError(f"grid_thw={tuple(grid_thw)}: t, h, w must be >= 1 and h, w multiples of merge size {m}")
    return t * (h // m) * (w // m)


def sequence_mrope_positions(
    seq_len: int, images: Sequence[ImageSpan], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """The MRoPE positions of one whole sequence.

    Args:
        seq_len: tokens of the sequence (image pad tokens included).
        images: its images in token order; their token ranges must lie inside the sequence and not overlap.
        spatial_merge_size: the vision tower's ``m``.
    Returns:
        (int64 [3, seq_len] positions (rows t, h, w), ``next_position``: the position the token after the
        sequence gets on all three rows; a decode continues from it, ``next_position - seq_len`` <= 0 is
        transformers' ``rope_deltas``).
    Raises:
        LayoutError: an image outside the sequence, overlapping the previous one, or with a bad grid.
    """
    out = torch.empty(3, seq_len, dtype=torch.int64)
    cursor, position = 0, 0
    for index, (start, grid) in enumerate(images):
        count = image_token_count(grid, spatial_merge_size)
        if start < cursor or start + count > seq_len:
            raise LayoutError(
                f"image {index}: tokens [{start}, {start + count}) must lie in [{cursor}, {seq_len}) "
                "(inside the sequence, after the previous image)"
            )
        text = start - cursor
        out[:, cursor:start] = torch.arange(position, position + text, dtype=torch.int64)
        position += text
        t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
        ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[:, start : start + count] = torch.stack([ti, hi, wi]).reshape(3, -1) + position
        position += max(h, w)
        cursor = start + count
    out[:, cursor:] = torch.arange(position, position + seq_len - cursor, dtype=torch.int64)
    return out, position + seq_len - cursor


def rope_offsets(seq_lens: Sequence[int], images: Sequence[Sequence[ImageSpan]], spatial_merge_size: int) -> list[int]:
    """Per sequence, ``next_position - seq_len`` (<= 0; 0 without images): a decode step's token in slot ``n`` of
    that sequence's cache is rotated at position ``n + offset`` (transformers' ``rope_deltas``)."""
    if len(images) != len(seq_lens):
        raise LayoutError(f"images: {len(images)} lists for {len(seq_lens)} sequences; need one per sequence")
    return [
        sequence_mrope_positions(n, imgs, spatial_merge_size)[1] - n if imgs else 0
        for n, imgs in zip(seq_lens, images, strict=True)
    ]


def row_mrope_positions(
    seq_lens: Sequence[int], images: Sequence[Sequence[ImageSpan]], spatial_merge_size: int
) -> torch.Tensor:
    """int64 [3, sum(seq_lens)]: every sequence of a packed row numbered on its own (sequence coordinates)."""
    if len(images) != len(seq_lens):
        raise LayoutError(f"images: {len(images)} lists for {len(seq_lens)} sequences; need one per sequence")
    parts = [sequence_mrope_positions(n, imgs, spatial_merge_size)[0] for n, imgs in zip(seq_lens, images, strict=True)]
    return torch.cat([torch.zeros(3, 0, dtype=torch.int64), *parts], dim=1)


def shard_mrope_positions(
    plan: ZigzagPlan, images: Sequence[Sequence[ImageSpan]], spatial_merge_size: int
) -> torch.Tensor:
    """int64 [3, plan.local_len]: this rank's zigzag slice of :func:`row_mrope_positions`.

    Real tokens take their sequence's positions; pads (tail pads, stream pad) take ``plan.positions`` on all
    three rows, as a text shard's pads do (they are never scored and no real token attends to them).
    """
    full = row_mrope_positions(plan.seq_lens, images, spatial_merge_size)
    out = plan.positions.expand(3, -1).clone()
    real = plan.is_real
    out[:, real] = full[:, plan.row_index[real]]
    return out


def check_shard_mrope_positions(
    positions: torch.Tensor, plan: ZigzagPlan, images: Sequence[Sequence[ImageSpan]], spatial_merge_size: int
) -> None:
    """Raise ParallelConfigError unless ``positions`` are the zigzag slice of the row's whole-sequence MRoPE.

    The run-time guard of CP-sharded multimodal rows: positions numbered on a rank's shard (its two chunks
    of each sequence taken as one sequence) differ from the sequence's at the second chunk or after an image
    and are refused here, naming the first local token that differs.
    """
    want = shard_mrope_positions(plan, images, spatial_merge_size)
    if tuple(positions.shape) != tuple(want.shape):
        raise ParallelConfigError(
            f"mrope positions must be int64 [3, local_len={plan.local_len}]; got {positions.shape}"
        )
    bad = (positions.to(want.device) != want).any(0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ParallelConfigError(
            f"mrope positions of local token {i} (row token {int(plan.row_index[i])}) are "
            f"{positions[:, i].tolist()}, but its sequence numbers it {want[:, i].tolist()}; MRoPE positions must "
            "be built on each whole sequence and zigzag-sliced (ringtune.layout.mrope.shard_mrope_positions), "
            "not numbered on the shard"
        )
