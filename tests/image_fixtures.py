"""Shared pieces of the image tests: a tiny Qwen3.5-VL checkpoint written by transformers (``save_pretrained`` of
``Qwen3_5ForConditionalGeneration`` and of the Qwen2-VL image processor), a byte-level tokenizer that knows
Qwen's chat and vision tokens (so the cookbook's ``qwen3_5`` renderer runs on it), and PNG / JPEG bytes of
random images made with PIL."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")
"""Chat tokens the cookbook's Qwen3.5 renderer writes, at ids 256.. (after the 256 byte tokens)."""
VISION_TOKENS = {"<|vision_start|>": 288, "<|vision_end|>": 289, "<|image_pad|>": 290, "<|video_pad|>": 291}
"""The vision tokens at the ids ``config.json`` names (``vision_start_token_id`` ...)."""
VOCAB = 296
PATCH, MERGE, TEMPORAL = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 32 * 32, 32 * 32 * 64
"""The processor's pixel range: images resize to 1 .. 64 merged tokens (4 .. 256 patches)."""


def vl_config():
    """A transformers ``Qwen3_5Config``: the tiny text model of the gateway tests (vocab :data:`VOCAB`, MRoPE
    sections for a rotary dim of 4) and a 2-block vision tower of patch 16, merge 2."""
    import transformers

    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    }
    vision = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
        "out_hidden_size": 32,
        "num_position_embeddings": 64,
    }
    ids = {name.strip("<|>") + "_token_id": i for name, i in VISION_TOKENS.items()}
    return transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_pad_token_id"],
        video_token_id=ids["video_pad_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=True,
    )


def image_processor():
    """The Qwen2-VL image processor (PIL backend) of the tiny checkpoint."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    )


def tiny_vl_dir(dest: Path, *, weights: bool) -> Path:
    """A tiny Qwen3.5-VL checkpoint in ``dest``: ``config.json``, ``preprocessor_config.json``, the tokenizer of
    :func:`write_tokenizer`, and (``weights``) random weights of ``Qwen3_5ForConditionalGeneration``, seed 0."""
    import torch
    import transformers

    dest.mkdir(parents=True, exist_ok=True)
    config = vl_config()
    if weights:
        torch.manual_seed(0)
        transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(dest)
    else:
        config.save_pretrained(dest)
    image_processor().save_pretrained(dest)
    write_tokenizer(dest)
    return dest


def write_tokenizer(dest: Path) -> None:
    """A byte-level BPE tokenizer without merges (ids 0..255: bytes) plus :data:`SPECIAL_TOKENS` and
    :data:`VISION_TOKENS` as special tokens at their ids; eos ``<|im_end|>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for text, token_id in VISION_TOKENS.items():
        while tokenizer.get_vocab_size() < token_id:  # filler up to the configured id
            tokenizer.add_tokens([AddedToken(f"<|unused{tokenizer.get_vocab_size()}|>", normalized=False)])
        tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        assert tokenizer.token_to_id(text) == token_id, (text, tokenizer.token_to_id(text))
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))


def image_bytes(width: int, height: int, fmt: str = "png", *, seed: int = 0, mode: str = "RGB") -> bytes:
    """A ``width`` x ``height`` image of random pixels, encoded as ``fmt`` (PIL's name, e.g. ``png``, ``jpeg``)."""
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels)  # mode from the shape
    out = io.BytesIO()
    image.save(out, format=fmt.upper())
    return out.getvalue()
