"""One image of a datum or prompt, as the vision tower takes it: the contract between the gateway and the model.

The gateway (:mod:`ringtune.gateway`) decodes an SDK ``ImageChunk`` (JPEG/PNG bytes) with the image processor the
checkpoint names and expands the chunk into ``num_tokens`` copies of the model's image-pad token id in the datum's
``tokens``; the model (:mod:`ringtune.models`) encodes ``pixel_values`` with its vision tower and scatters the
embeddings onto exactly those positions. Positions (MRoPE) are built per whole sequence from ``grid_thw``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image.

    - ``pixel_values``: float32 ``[num_patches, channels * temporal_patch_size * patch_size**2]``, as the
      transformers image processor of the checkpoint's family returns it for this one image (on the CPU).
    - ``grid_thw``: ``(t, h, w)`` patch grid of the image (``num_patches == t * h * w``).
    - ``token_start``: index, in the datum's ``tokens``, of the first of its image-pad tokens.
    - ``num_tokens``: image-pad tokens it occupies, ``t * h * w // spatial_merge_size**2``; these are contiguous.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    token_start: int
    num_tokens: int

    @property
    def token_end(self) -> int:
        """One past the index of its last image-pad token."""
        return self.token_start + self.num_tokens
