"""Image bytes -> what the vision tower takes: decoded, preprocessed by the checkpoint's own image processor.

An SDK ``ImageChunk`` carries JPEG or PNG bytes, its ``format`` and (advisory) ``expected_tokens``. The server
decodes the bytes with PIL (PNG and JPEG decoders only), runs transformers' image processor of the checkpoint
(``AutoImageProcessor.from_pretrained(<checkpoint dir>)``, i.e. its ``preprocessor_config.json``; for Qwen3.5 the
Qwen2-VL processor: ``smart_resize`` to multiples of ``patch_size * merge_size`` within its pixel range, then
patches) and counts the image's tokens as the model does: ``t * h * w // merge_size**2`` of the patch grid.

Every refusal is a :class:`~ringtune.errors.UserInputError` naming the chunk (``where``), the value and the limit:
bytes that are not a PNG / JPEG image, a ``format`` other than the bytes', an animated image, more bytes or
decoded pixels than :class:`ImageLimits` allow, more patches in one request than its budget, an aspect ratio
the processor refuses, and an ``expected_tokens`` other than the computed count. Nothing is changed by a refusal
(decoding happens before any engine work).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ringtune.errors import UserInputError
from ringtune.gateway.backend import BackendInfo

FORMATS = {"png": "PNG", "jpeg": "JPEG"}
"""The ``ImageChunk.format`` values tinker 0.38 sends, and PIL's name of each."""

VL_CONFIG_FIELDS = ("vision_config", "image_token_id")
"""What a checkpoint's ``config.json`` must hold for its images to be decoded here."""


@dataclass(frozen=True, kw_only=True)
class ImageLimits:
    """What one image and one request may cost before anything is decoded or preprocessed.

    - ``max_image_bytes``: encoded bytes of one image.
    - ``max_image_pixels``: ``width * height`` of one decoded image (read from the header, before decoding).
    - ``max_request_patches``: vision patches (``t * h * w`` after the processor's resize) of all the images of
      one request together: the vision tower's work and ``pixel_values`` memory of the request.
    """

    max_image_bytes: int = 32 << 20
    max_image_pixels: int = 8192 * 8192
    max_request_patches: int = 1 << 20


class PatchBudget:
    """The vision patches one request may still spend (:attr:`ImageLimits.max_request_patches`)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, patches: int, where: str) -> None:
        """Spend ``patches``; UserInputError naming ``where`` when the request's total would pass the limit."""
        if self.used + patches > self.limit:
            raise UserInputError(
                f"{where}: {patches} vision patches bring this request's images to {self.used + patches}; the "
                f"limit is {self.limit} patches per request (send fewer or smaller images, or split the request)"
            )
        self.used += patches


@dataclass(frozen=True)
class DecodedImage:
    """One preprocessed image: ``pixel_values`` float32 [t*h*w, C * temporal_patch * patch**2] (CPU),
    ``grid_thw`` its patch grid, ``num_tokens`` = ``t*h*w // merge_size**2`` image-pad tokens."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int


class ImageDecoder:
    """Decodes image chunks for one checkpoint (see the module docstring).

    Args:
        processor: a transformers image processor of the Qwen2-VL kind (``merge_size``; called as
            ``processor(images=[pil], return_tensors="pt")`` -> ``pixel_values``, ``image_grid_thw``).
        image_token_id: the model's image-pad token id (``config.json``'s ``image_token_id``).
        limits: what one image and one request may cost.
    """

    def __init__(self, processor: Any, *, image_token_id: int, limits: ImageLimits = ImageLimits()) -> None:
        self.processor, self.image_token_id, self.limits = processor, image_token_id, limits
        self.merge_size = int(processor.merge_size)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, limits: ImageLimits = ImageLimits()) -> ImageDecoder:
        """The decoder of an HF checkpoint directory: ``config.json`` (``image_token_id``,
        ``vision_config.spatial_merge_size``) and ``preprocessor_config.json`` (the image processor).

        Raises:
            ValueError: the directory is not a vision-language checkpoint, or its processor's ``merge_size``
                differs from the vision tower's ``spatial_merge_size`` (a server configuration error).
        """
        from transformers import AutoImageProcessor

        config = vl_config(model_dir)
        if config is None:
            raise ValueError(f"{model_dir}: not a vision-language checkpoint (config.json needs {VL_CONFIG_FIELDS})")
        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        merge = config["vision_config"].get("spatial_merge_size", 2)
        if int(getattr(processor, "merge_size", -1)) != int(merge):
            raise ValueError(
                f"{model_dir}: preprocessor_config.json merge_size={getattr(processor, 'merge_size', None)} but "
                f"config.json vision_config.spatial_merge_size={merge}; the image token count would be wrong"
            )
        return cls(processor, image_token_id=int(config["image_token_id"]), limits=limits)

    def decode(self, data: bytes, fmt: str, where: str, budget: PatchBudget) -> DecodedImage:
        """Decode and preprocess one image chunk's bytes; spends its patches from ``budget``.

        Args:
            data: the encoded image. fmt: the chunk's ``format`` (``png`` / ``jpeg``).
            where: the chunk's field path for error messages (e.g. ``data[0].model_input.chunks[2]``).
        Raises:
            UserInputError: see the module docstring.
        """
        pil = self._open(data, fmt, where)
        try:
            out = self.processor(images=[pil], return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:  # e.g. smart_resize's aspect ratio limit, odd modes
            width, height = pil.size
            raise UserInputError(f"{where}: the image processor refused this {width}x{height} image: {exc}") from None
        grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
        patches = grid[0] * grid[1] * grid[2]
        budget.take(patches, where)
        pixel_values = out["pixel_values"].to(torch.float32)
        if pixel_values.shape[0] != patches:
            raise RuntimeError(f"{where}: the processor gave {pixel_values.shape[0]} patches for grid {grid}")
        return DecodedImage(pixel_values, grid, patches // self.merge_size**2)  # type: ignore[arg-type]

    def _open(self, data: bytes, fmt: str, where: str) -> Any:
        """The decoded PIL image after the format, size and frame checks (pixels loaded)."""
        from PIL import Image, UnidentifiedImageError

        if fmt not in FORMATS:
            raise UserInputError(f"{where}.format={fmt!r}: supported formats are {sorted(FORMATS)}")
        limits = self.limits
        if not data:
            raise UserInputError(f"{where}.data: 0 bytes; send the encoded {fmt} image")
        if len(data) > limits.max_image_bytes:
            raise UserInputError(
                f"{where}.data: {len(data)} bytes; the limit is {limits.max_image_bytes} bytes per image"
            )
        try:
            pil = Image.open(io.BytesIO(data), formats=list(FORMATS.values()))
        except Image.DecompressionBombError as exc:
            raise UserInputError(f"{where}: {exc}; the limit is {limits.max_image_pixels} pixels") from None
        except (UnidentifiedImageError, OSError, ValueError):
            raise UserInputError(f"{where}.data: {len(data)} bytes are not a PNG or JPEG image") from None
        if pil.format != FORMATS[fmt]:
            raise UserInputError(f"{where}.format={fmt!r} but the bytes are a {pil.format} image")
        width, height = pil.size
        if width * height > limits.max_image_pixels:
            raise UserInputError(
                f"{where}: a {width}x{height} image has {width * height} pixels; the limit is "
                f"{limits.max_image_pixels} pixels per image (downscale it before sending)"
            )
        if getattr(pil, "n_frames", 1) != 1:
            raise UserInputError(f"{where}: an animated image of {pil.n_frames} frames; send a still image")
        try:
            pil.load()
        except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data past the header
            raise UserInputError(f"{where}.data: the {fmt} image does not decode ({exc})") from None
        return pil


def vl_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint's ``config.json`` if it describes a vision-language model (has :data:`VL_CONFIG_FIELDS`)
    and the directory holds a ``preprocessor_config.json``; else None (a text-only checkpoint)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file() or not (path / "preprocessor_config.json").is_file():
        return None
    config = json.loads((path / "config.json").read_text())
    return config if all(config.get(k) is not None for k in VL_CONFIG_FIELDS) else None


@cache
def decoder_of(model_dir: str) -> ImageDecoder:
    """:meth:`ImageDecoder.from_checkpoint` of ``model_dir`` with the default limits, loaded once per process."""
    return ImageDecoder.from_checkpoint(model_dir)


def image_decoder(info: BackendInfo) -> ImageDecoder | None:
    """The served model's decoder (:attr:`BackendInfo.image_dir`), or None for a model that takes no images."""
    return None if info.image_dir is None else decoder_of(info.image_dir)
