"""A model input's image chunks expanded into image-pad tokens and :class:`~ringtune.models.image_input.ImageInput`.

Both wire paths (the protobuf ``Chunk.image`` of forward/forward_backward, the base64 JSON image chunk of
``asample``) hand over a model input as its text tokens (the ``encoded_text`` chunks concatenated) and its image
chunks, each with the offset in those text tokens where it sits. The client (the cookbook's Qwen3.5 renderer)
puts ``<|vision_start|>`` before and ``<|vision_end|>`` after each image as text; the server replaces the image
chunk by ``num_tokens`` copies of the model's image-pad id, as transformers' processor expands
``<|image_pad|>``, so the datum's length is the one the client computed from ``expected_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringtune.errors import UserInputError
from ringtune.gateway.images import ImageDecoder, PatchBudget
from ringtune.gateway.proto import WireImage, refuse_images
from ringtune.models.image_input import ImageInput


def expand_images(
    text: np.ndarray,
    images: Sequence[WireImage],
    decoder: ImageDecoder | None,
    budget: PatchBudget | None,
    where: str,
) -> tuple[np.ndarray, tuple[ImageInput, ...]]:
    """The model input's tokens with every image expanded, and its images in token order.

    Args:
        text: int64 [n], the text tokens; ``images``: sorted by ``offset`` (each in [0, n]).
        decoder: the served checkpoint's decoder, or None (a text-only model: images refused by
            :func:`refuse_images`). budget: the request's patch budget (None only without images).
        where: the model input's field path, for a stray image-pad token in the text.
    Returns:
        ``tokens`` int64 [n + sum(num_tokens)] and one :class:`ImageInput` per image
        (``token_start`` indexes ``tokens``).
    Raises:
        UserInputError: images for a text-only model, a text token equal to the image-pad id, a chunk the decoder
            refuses, or ``expected_tokens`` other than the computed count (naming the chunk and both counts).
    """
    if not images:
        return text, ()
    if decoder is None or budget is None:
        refuse_images(images)
        raise AssertionError("unreachable")
    pad = decoder.image_token_id
    stray = np.flatnonzero(text == pad)
    if stray.size:
        raise UserInputError(
            f"{where}: text token {int(stray[0])} is the image-pad id {pad} ({stray.size} in all); images must "
            "come as image chunks, which the server expands into image-pad tokens"
        )
    parts: list[np.ndarray] = []
    inputs: list[ImageInput] = []
    at = length = 0
    for image in images:
        decoded = decoder.decode(image.data, image.format, image.where, budget)
        if image.expected_tokens is not None and image.expected_tokens != decoded.num_tokens:
            h, w = decoded.grid_thw[1:]
            raise UserInputError(
                f"{image.where}.expected_tokens={image.expected_tokens} but the image is {decoded.num_tokens} "
                f"tokens (patch grid {h}x{w}, merge {decoder.merge_size}x{decoder.merge_size}, as the checkpoint's "
                "image processor resizes it); compute expected_tokens with the model's image processor"
            )
        parts.append(text[at : image.offset])
        length += image.offset - at
        at = image.offset
        inputs.append(ImageInput(decoded.pixel_values, decoded.grid_thw, length, decoded.num_tokens))
        parts.append(np.full(decoded.num_tokens, pad, dtype=np.int64))
        length += decoded.num_tokens
    parts.append(text[at:])
    return np.concatenate(parts).astype(np.int64), tuple(inputs)
