"""The vision tower of a Qwen3.5 VL checkpoint in the memory plan: its parameters and its image activations.

Parameters are counted from the checkpoint's ``vision_config`` as transformers' ``Qwen3_5VisionModel`` defines
them (checked against its ``named_parameters`` on a tiny model, ``tests/test_plan_vision.py``): the patch embed
(a Conv3d of ``C·T·P²`` inputs), the learned position table, ``depth`` blocks (two LayerNorms, qkv and proj
with biases, a two-layer GELU MLP) and the merger (LayerNorm, ``h·m² → h·m² → out_hidden``).

Activations are the image patches a rank encodes: the tower is per image and a rank encodes every image of
which its zigzag shard holds a token (:mod:`ringtune.models.vision.placement` on the model side), so a rank of
a row holding ``image_tokens`` image-pad tokens encodes about ``image_tokens / cp`` of them (plus the few images
straddling its chunk boundaries, not counted), i.e. ``m²`` patches per image token. What a block keeps per patch
is an inventory of the tensors the transformers block saves (:func:`kept_per_patch`), not yet checked against
autograd on ringtune's own tower (that lands with the model side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig


@dataclass(frozen=True, kw_only=True)
class VisionShape:
    """The sizes of a ``vision_config`` the plan needs (transformers' defaults for absent fields)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    in_channels: int
    patch: int
    temporal: int
    merge: int
    out_hidden: int
    positions: int

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> VisionShape:
        """From the ``vision_config`` dict of an HF ``config.json``."""
        return cls(
            depth=int(vision.get("depth", 27)),
            hidden=int(vision.get("hidden_size", 1152)),
            intermediate=int(vision.get("intermediate_size", 4304)),
            heads=int(vision.get("num_heads", 16)),
            in_channels=int(vision.get("in_channels", 3)),
            patch=int(vision.get("patch_size", 16)),
            temporal=int(vision.get("temporal_patch_size", 2)),
            merge=int(vision.get("spatial_merge_size", 2)),
            out_hidden=int(vision.get("out_hidden_size", 3584)),
            positions=int(vision.get("num_position_embeddings", 2304)),
        )

    @property
    def patch_dim(self) -> int:
        """Inputs of one patch: ``C · T · P²`` (a row of the processor's ``pixel_values``)."""
        return self.in_channels * self.temporal * self.patch**2


def vision_shape(cfg: DecoderConfig) -> VisionShape | None:
    """The tower of ``cfg``'s checkpoint (its HF config's ``vision_config``), or None for a text-only config."""
    vision = cfg.hf_config.get("vision_config")
    return VisionShape.from_hf(vision) if isinstance(vision, dict) else None


def vision_parameters(v: VisionShape) -> int:
    """Parameters of the tower (see the module docstring)."""
    h, i, m2 = v.hidden, v.intermediate, v.merge**2
    patch_embed = v.patch_dim * h + h
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    merger = 2 * h + (h * m2 * h * m2 + h * m2) + (h * m2 * v.out_hidden + v.out_hidden)
    return patch_embed + v.positions * h + v.depth * block + merger


def kept_per_patch(v: VisionShape, e: int, a: int) -> float:
    """Bytes the tower keeps for its backward per patch (``e``: compute bytes, ``a``: accumulator bytes).

    Per block: the two LayerNorms' inputs and statistics (2·h·e + 4·a), qkv's input and q, k, v (4·h·e), the rotary
    copies of q and k (2·h·e), the attention output and its log-sum-exp per head (h·e + heads·a), proj's input,
    fc1's input and output, GELU's output (2·h·e + 2·i·e); before the blocks the patch row and the embedded patch
    (patch_dim·e + 2·h·e); the merger's inputs per patch (3·h·e) and its hidden per merged token.
    """
    h, i = v.hidden, v.intermediate
    block = (2 * h + 4 * h + 2 * h + h + 2 * h) * e + 2 * i * e + (4 + v.heads) * a
    merger = 3 * h * e + (h * v.merge**2 + v.out_hidden) * e / v.merge**2
    return v.depth * block + (v.patch_dim + 2 * h) * e + merger


def rank_patches(v: VisionShape, image_tokens: int, cp: int) -> int:
    """Patches one rank encodes for a row of ``image_tokens`` image-pad tokens at CP ``cp`` (its share)."""
    return math.ceil(image_tokens / cp) * v.merge**2


def check_image_tokens(cfg: DecoderConfig, image_tokens: int, context: int | None = None) -> VisionShape | None:
    """The tower to plan for ``image_tokens`` image tokens per row (None: a text config and no image tokens).

    UserInputError naming ``--image-tokens``: negative, more than the row's ``context``, or image tokens for a
    config without a ``vision_config``.
    """
    if isinstance(image_tokens, bool) or not isinstance(image_tokens, int) or image_tokens < 0:
        raise UserInputError(f"--image-tokens={image_tokens!r}: must be an integer >= 0")
    if context is not None and image_tokens > context:
        raise UserInputError(f"--image-tokens={image_tokens}: more than the row's {context} tokens (--context-length)")
    shape = vision_shape(cfg)
    if image_tokens and shape is None:
        raise UserInputError(
            f"--image-tokens={image_tokens}: the model has no vision tower (its config.json has no vision_config)"
        )
    return shape
