"""The vision tower's configuration, read from a Qwen3.5 VL ``config.json`` (``vision_config`` + token ids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtune.errors import UserInputError

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """Shapes of transformers' ``Qwen3_5VisionModel`` (the MoE family's tower is the same module).

    ``patch_dim = in_channels · temporal_patch_size · patch_size²`` is the width of an image's
    ``pixel_values`` rows; ``spatial_merge_size`` (m) merges m×m patches into one decoder token of width
    ``out_hidden_size`` (the decoder's hidden size). ``image_token_id``: the pad token an image's tokens carry.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    image_token_id: int

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, text_hidden_size: int) -> VisionConfig | None:
        """The tower of a VL config dict (``model_type`` qwen3_5 / qwen3_5_moe with ``vision_config``), else None.

        Raises UserInputError naming the field when the tower cannot feed this decoder (``out_hidden_size`` !=
        the text hidden size) or uses an activation or shape the module does not implement.
        """
        vision = hf.get("vision_config")
        if not isinstance(vision, dict) or hf.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
            return None
        rope = dict(vision.get("rope_parameters") or {})
        config = cls(
            depth=int(vision.get("depth", 27)),
            hidden_size=int(vision.get("hidden_size", 1152)),
            intermediate_size=int(vision.get("intermediate_size", 4304)),
            num_heads=int(vision.get("num_heads", 16)),
            in_channels=int(vision.get("in_channels", 3)),
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            out_hidden_size=int(vision.get("out_hidden_size", 3584)),
            num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(hf.get("image_token_id", 248056)),
        )
        if config.out_hidden_size != text_hidden_size:
            raise UserInputError(
                f"config.vision_config.out_hidden_size={config.out_hidden_size} must equal the text hidden_size "
                f"{text_hidden_size}"
            )
        if config.hidden_act not in VISION_ACTIVATIONS:
            raise UserInputError(
                f"config.vision_config.hidden_act={config.hidden_act!r}: supported {VISION_ACTIVATIONS}"
            )
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise UserInputError(
                f"config.vision_config: hidden_size={config.hidden_size} / num_heads={config.num_heads} must be a "
                "whole head dim divisible by 4 (2-D rotary)"
            )
        side = int(config.num_position_embeddings**0.5)
        if side * side != config.num_position_embeddings:
            raise UserInputError(
                f"config.vision_config.num_position_embeddings={config.num_position_embeddings} must be a square"
            )
        return config
