"""The model ``ringtune plan`` plans for: an HF ``config.json``, a checkpoint directory, or a known name.

Known names carry the published text configs of the Qwen3.5 dense hybrids (values of the Hugging Face
``Qwen/Qwen3.5-4B`` and ``Qwen/Qwen3.5-27B`` ``config.json`` text configs, as quoted in public code that
loads them: hidden 2560 / 5120, 32 / 64 layers with full attention every 4th, SwiGLU 9216 / 17408, gated
attention 16 / 24 query and 4 kv heads of 256, GatedDeltaNet 16 key heads and 32 / 48 value heads of 128,
vocabulary 248320, tied embeddings for 4B only, rotary theta 1e7 on a quarter of each head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig


def _qwen35(*, hidden: int, layers: int, intermediate: int, heads: int, v_heads: int, tied: bool) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    }


KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen3.5-4B": _qwen35(hidden=2560, layers=32, intermediate=9216, heads=16, v_heads=32, tied=True),
    "Qwen3.5-27B": _qwen35(hidden=5120, layers=64, intermediate=17408, heads=24, v_heads=48, tied=False),
}
"""Published text configs by name (source: the HF ``config.json`` of each model; see the module docstring)."""


def resolve_model(spec: str) -> tuple[str, DecoderConfig]:
    """``(name, config)`` of a known name (case-insensitive), a ``config.json`` file or a directory holding one.

    Raises UserInputError naming ``--model``, the value and what is accepted.
    """
    by_lower = {name.lower(): name for name in KNOWN_MODELS}
    if spec.lower() in by_lower:
        name = by_lower[spec.lower()]
        return name, DecoderConfig.from_hf(KNOWN_MODELS[name])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserInputError(
            f"--model={spec!r}: not a known name ({', '.join(KNOWN_MODELS)}), a config.json file or a directory "
            "holding one"
        )
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserInputError(f"--model={spec!r}: {path} is not readable JSON ({exc})") from exc
    if not isinstance(hf, dict):
        raise UserInputError(f"--model={spec!r}: {path} must hold a JSON object; got {type(hf).__name__}")
    return str(spec), DecoderConfig.from_hf(hf)
