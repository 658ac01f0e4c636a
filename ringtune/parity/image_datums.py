"""The image datums of ``ringtune parity run`` on a server that takes images (a vision-language checkpoint).

Three datums of text and 1, 2 and 3 seeded random PNG images of different sizes, laid out as the cookbook's
Qwen3.5 renderer lays them out: ``<|vision_start|>`` image ``<|vision_end|>`` between runs of the parity text. Each
image's ``expected_tokens`` is counted with the checkpoint's own image processor (as a client does); its targets
follow the cookbook's next-token shift (0 where the next token is an image token) with weight 0 there, so only
text positions are scored, and the text after an image tests that the image reached the model and its positions.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_SIZES = ((64, 48), (40, 120), (96, 96), (33, 70), (128, 40), (50, 50))
"""(width, height) of the images, in order of use; small enough for a 1K-token row at Qwen3.5's 32-pixel tokens."""
IMAGES_PER_DATUM = (1, 2, 3)
TEXT_RUN = 12
"""Text tokens before, between and after the images of a datum."""


@dataclass(frozen=True)
class ImageChunkSpec:
    """One image of a datum: ``png`` bytes and its ``expected_tokens``."""

    png: bytes
    expected_tokens: int


@dataclass(frozen=True)
class ImageParityDatum:
    """One datum: ``chunks`` in order (a tuple of token ids, or an image), ``targets`` and ``weights`` (one per
    model-input token, images expanded)."""

    name: str
    chunks: tuple[tuple[int, ...] | ImageChunkSpec, ...]
    targets: tuple[int, ...]
    weights: tuple[float, ...]
    kind: str = "images"


@dataclass(frozen=True)
class VisionIds:
    """The checkpoint's ``vision_start_token_id``, ``vision_end_token_id`` and ``image_token_id``."""

    start: int
    end: int
    pad: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionIds:
        return cls(
            int(config["vision_start_token_id"]), int(config["vision_end_token_id"]), int(config["image_token_id"])
        )


def png_bytes(width: int, height: int, rng: np.random.Generator) -> bytes:
    """A seeded random RGB image as PNG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def count_tokens(processor: Any, width: int, height: int) -> int:
    """Image tokens of a ``width`` x ``height`` image: the processor's patches // ``merge_size**2`` (the cookbook's
    ``image_to_chunk`` rule)."""
    return processor.get_number_of_image_patches(height, width, images_kwargs={}) // processor.merge_size**2


def build_image_datums(
    *, seed: int, stream: Sequence[int], processor: Any, ids: VisionIds
) -> tuple[ImageParityDatum, ...]:
    """The image datums (see the module docstring): a pure function of the seed, the text ``stream``, the processor's
    resize rule and the vision ids."""
    rng = np.random.default_rng(seed + 7)
    base = list(stream)
    sizes = iter(IMAGE_SIZES)
    out = []
    for n_images in IMAGES_PER_DATUM:
        chunks: list[tuple[int, ...] | ImageChunkSpec] = []
        flat: list[int] = []  # the model input, images expanded into pads (for the shift)
        for k in range(n_images + 1):
            start = int(rng.integers(0, max(1, len(base) - TEXT_RUN)))
            text = [*(base[start : start + TEXT_RUN] if k == 0 else [ids.end, *base[start : start + TEXT_RUN]])]
            if k < n_images:
                text.append(ids.start)
            chunks.append(tuple(text))
            flat += text
            if k < n_images:
                width, height = next(sizes)
                image = ImageChunkSpec(png_bytes(width, height, rng), count_tokens(processor, width, height))
                chunks.append(image)
                flat += [ids.pad] * image.expected_tokens
        last = chunks.pop()  # the cookbook's right shift: the input drops the last token, the targets the first
        chunks.append(tuple(last[:-1]))  # type: ignore[index]
        image_next = [t == ids.pad for t in flat[1:]]
        targets = [0 if pad else t for t, pad in zip(flat[1:], image_next, strict=True)]
        drawn = rng.uniform(0.5, 1.5, len(targets))
        weights = [0.0 if pad else float(w) for pad, w in zip(image_next, drawn, strict=True)]
        out.append(ImageParityDatum(f"images{n_images}", tuple(chunks), tuple(targets), tuple(weights)))
    return tuple(out)


def image_digest(datums: Sequence[ImageParityDatum]) -> str:
    """SHA-256 of every chunk (image bytes included), target and weight."""
    h = hashlib.sha256()
    for d in datums:
        h.update(repr((d.name, d.targets, d.weights)).encode())
        for c in d.chunks:
            h.update(c.png + str(c.expected_tokens).encode() if isinstance(c, ImageChunkSpec) else repr(c).encode())
    return h.hexdigest()


def load_image_side(image_dir: str | Path) -> tuple[Any, VisionIds]:
    """The image processor and vision ids of the checkpoint in ``image_dir`` (what the server reports as its
    ``image_dir``; parity runs on the server's host)."""
    import json

    from transformers import AutoImageProcessor

    config = json.loads((Path(image_dir) / "config.json").read_text())
    return AutoImageProcessor.from_pretrained(str(image_dir)), VisionIds.from_config(config)
