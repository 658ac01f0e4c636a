"""The prompt of an ``asample`` call (a JSON ``ModelInput``) as token ids and images.

SDK 0.38 sends ``{"chunks": [...]}`` with ``encoded_text`` chunks (``tokens``: a list of ids) and ``image`` chunks
(``data``: base64 of the PNG / JPEG bytes, ``format``, ``expected_tokens``, as ``ImageChunk``'s serializer writes
them). Image chunks are decoded and expanded like a datum's (:mod:`ringtune.gateway.image_chunks`) for a model that
takes images, and refused by name otherwise; ``image_asset_pointer`` chunks (a location, no bytes) are refused.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from ringtune.errors import UserInputError
from ringtune.gateway.image_chunks import expand_images
from ringtune.gateway.images import ImageDecoder, PatchBudget
from ringtune.gateway.proto import WireImage, refuse_images
from ringtune.models.image_input import ImageInput


def _image_chunk(chunk: dict[str, Any], where: str, offset: int) -> WireImage:
    """A JSON image chunk as a :class:`WireImage` (its bytes base64-decoded); UserInputError naming the field."""
    data = chunk.get("data")
    if not isinstance(data, str):
        raise UserInputError(f"{where}.data: expected the image's bytes as a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise UserInputError(f"{where}.data: {len(data)} characters are not valid base64") from None
    fmt = chunk.get("format")
    expected = chunk.get("expected_tokens")
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int) or expected < 0):
        raise UserInputError(f"{where}.expected_tokens={expected!r} must be a non-negative int or null")
    return WireImage(raw, fmt if isinstance(fmt, str) else repr(fmt), expected, offset, where)


def prompt_input(
    prompt: dict[str, Any], vocab_size: int, images: ImageDecoder | None = None
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's token ids (images expanded into image-pad ids) and its images in token order.

    ``images``: the served checkpoint's decoder, or None (a text model: image chunks refused by name).
    UserInputError naming the chunk: an unknown chunk type, an id outside ``[0, vocab_size)``, no tokens at all,
    or an image the decoder refuses (:func:`~ringtune.gateway.image_chunks.expand_images`).
    """
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise UserInputError("prompt.chunks: expected a non-empty list of chunks")
    tokens: list[int] = []
    wire_images: list[WireImage] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type") if isinstance(chunk, dict) else None
        where = f"prompt.chunks[{i}]"
        if kind == "image":
            wire_images.append(_image_chunk(chunk, where, len(tokens)))
            if images is None:
                refuse_images(wire_images)
            continue
        if kind != "encoded_text":
            accepted = "encoded_text and image" if images is not None else "encoded_text"
            raise UserInputError(f"{where}.type={kind!r}: only {accepted} chunks are supported")
        ids = chunk.get("tokens")
        if not isinstance(ids, list):
            raise UserInputError(f"{where}.tokens: expected a list of token ids")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise UserInputError(f"{where}.tokens[{j}]={t!r} is outside the vocabulary [0, {vocab_size})")
        tokens.extend(ids)
    budget = PatchBudget(images.limits.max_request_patches) if images is not None else None
    expanded, inputs = expand_images(np.asarray(tokens, dtype=np.int64), wire_images, images, budget, "prompt")
    if not expanded.size:
        raise UserInputError("prompt: 0 tokens; a prompt needs at least 1")
    return expanded.tolist(), inputs
