"""Checks of a datum's images against its tokens and the model's vision tower, before any compute.

The gateway builds the :class:`~ringtune.models.image_input.ImageInput` objects (decoding, preprocessing,
``expected_tokens``); these checks are the model's side of that contract, run where a request enters the
engine (:func:`ringtune.engine.batch.build_batch`): a violation is a :class:`~ringtune.errors.UserInputError`
naming the datum, the image and the value, and nothing runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtune.errors import UserInputError
from ringtune.models.image_input import ImageInput
from ringtune.models.vision.config import VisionConfig


def check_images(
    images: Sequence[Any], tokens: torch.Tensor, field: str, vision: VisionConfig | None
) -> tuple[ImageInput, ...]:
    """``images`` of one datum (``field`` names it, e.g. ``data[3]``) with int64 ``tokens`` [N], checked.

    Each image: an :class:`ImageInput`; ``grid_thw`` positive ints with h, w multiples of the merge size;
    ``pixel_values`` a finite float tensor [t·h·w, patch_dim]; ``num_tokens == t·h·w / m²``; its tokens inside
    the datum, after the previous image's, and all the model's image token id. Returns them as a tuple.
    Raises UserInputError (a model with no vision tower refuses any image).
    """
    images = tuple(images)
    if not images:
        return ()
    if vision is None:
        raise UserInputError(f"{field}: {len(images)} image(s), but this model has no vision tower (text only)")
    cursor = 0
    for j, image in enumerate(images):
        where = f"{field}.images[{j}]"
        if not isinstance(image, ImageInput):
            raise UserInputError(f"{where}: expected an ImageInput; got {type(image).__name__}")
        grid = tuple(image.grid_thw)
        m = vision.spatial_merge_size
        if len(grid) != 3 or any(not isinstance(v, int) or v < 1 for v in grid) or grid[1] % m or grid[2] % m:
            raise UserInputError(f"{where}: grid_thw={grid} must be 3 positive ints with h, w multiples of {m}")
        t, h, w = grid
        pixels = image.pixel_values
        want = (t * h * w, vision.patch_dim)
        if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point() or tuple(pixels.shape) != want:
            got = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise UserInputError(f"{where}: pixel_values must be a float tensor {list(want)}; got {got}")
        if not bool(torch.isfinite(pixels).all()):
            raise UserInputError(f"{where}: pixel_values hold non-finite values")
        count = t * h * w // m**2
        if image.num_tokens != count:
            raise UserInputError(f"{where}: num_tokens={image.num_tokens}, but grid {grid} makes {count} tokens")
        start, end = image.token_start, image.token_end
        if start < cursor or end > tokens.numel():
            raise UserInputError(
                f"{where}: tokens [{start}, {end}) must lie in [{cursor}, {tokens.numel()}) (inside the datum, "
                "after the previous image)"
            )
        span = tokens[start:end]
        if bool((span != vision.image_token_id).any()):
            k = int((span != vision.image_token_id).nonzero()[0, 0])
            raise UserInputError(
                f"{where}: token {start + k} is {int(span[k])}, not the image token {vision.image_token_id}"
            )
        cursor = end
    return images
