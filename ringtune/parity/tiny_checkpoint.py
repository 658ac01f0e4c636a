"""The tiny random Qwen3.5 checkpoints the CPU parity matrix serves, built by ringtune alone (no transformers).

A model of :data:`TINY_CONFIGS` (4 layers: GDN, attention, GDN, attention; hidden 32, vocab 96; the MoE hybrid
with 8 experts, top-2 and a shared expert) is built as a :class:`~ringtune.models.decoder.CausalLM`, given random
weights by :func:`randomize_tiny_weights` (a seeded generator, so the same seed gives the same checkpoint on every
machine) and written by :func:`~ringtune.models.checkpoints.hf.save_hf` as an HF directory (``config.json`` +
safetensors) that ``ringtune serve`` and transformers both load, beside a 96-word word-level tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ringtune.models.checkpoints.hf import save_hf
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_5": {**_COMMON, "model_type": "qwen3_5_text", "intermediate_size": 48},
    "qwen3_5_moe": {
        **_COMMON,
        "model_type": "qwen3_5_moe_text",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "router_aux_loss_coef": 0.001,
    },
}
"""HF ``config.json`` of each tiny family. All-to-all attention fits CP=2 only (2 kv heads); GDN fits CP 2 and 4."""

WEIGHT_STD = 0.02
"""Std of every projection, embedding and conv weight (transformers' ``initializer_range`` default)."""
NORM_STD = 0.1
"""Std of the noise added to every norm weight, so no norm is the identity a bug could hide behind."""
ROUTER_STD = 0.5
"""Std of MoE router weights: logits of std ~3, so neighbouring tokens pick different experts (a zero or 0.02
router sends every token to nearly the same experts)."""

TINY_MARK = "tiny-random-weights"
"""File in a tiny checkpoint's folder naming its family and seed; :func:`tiny_qwen35_dir` reuses a folder only
when it matches."""


def randomize_tiny_weights(model: CausalLM, *, seed: int) -> None:
    """Draw every parameter of ``model`` in place from a generator seeded ``seed``, in ``named_parameters`` order.

    Projections, embeddings and convs: N(0, WEIGHT_STD²); norm weights: their identity value (0 for the
    zero-centred ``1 + w`` norms, 1 for the GDN output norm) + N(0, NORM_STD²); MoE routers (``mlp.gate``):
    N(0, ROUTER_STD²); GDN ``A_log``: evenly spaced over [-3, 1] (decays from fast to slow); ``dt_bias`` keeps
    its 1. Values are drawn in float64 and cast to the parameter's dtype, then rounded to bfloat16 once (stored in
    the parameter's dtype), so a bfloat16 server loads exactly the weights a float32 or float64 server holds.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                value = torch.linspace(-3.0, 1.0, p.numel(), dtype=torch.float64).reshape(p.shape)
            elif name.endswith("dt_bias"):
                value = p.detach().double()
            elif "norm" in name:
                value = p.detach().double() + NORM_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            else:
                std = ROUTER_STD if name.endswith("mlp.gate.weight") else WEIGHT_STD
                value = std * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(value.to(torch.bfloat16).to(p.dtype))


def _word_tokenizer(dest: Path) -> None:
    """``tokenizer.json`` (word level, ``w0`` .. ``w95``, split on whitespace) and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "w95", "pad_token": "w94", "unk_token": "w0"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_qwen35_dir(dest: Path, *, seed: int = 0, family: str = "qwen3_5") -> Path:
    """A random tiny Qwen3.5 of ``family`` (a key of :data:`TINY_CONFIGS`; ``qwen3_5_moe``: the MoE hybrid) in
    ``dest``: float32 safetensors whose values are bfloat16 values (:func:`randomize_tiny_weights`), its
    ``config.json`` and a 96-word tokenizer; reused when ``dest`` already holds the same family and seed.

    Raises ValueError for an unknown ``family``.
    """
    if family not in TINY_CONFIGS:
        raise ValueError(f"family must be one of {sorted(TINY_CONFIGS)}; got {family!r}")
    mark = f"family={family} seed={seed}: every weight is a bfloat16 value stored as float32\n"
    marked = dest / TINY_MARK
    if all((dest / name).is_file() for name in ("config.json", "tokenizer.json")) and marked.is_file():
        if marked.read_text() == mark:
            return dest
    model = CausalLM(DecoderConfig.from_hf(dict(TINY_CONFIGS[family])))
    randomize_tiny_weights(model, seed=seed)
    save_hf(model, dest)
    _word_tokenizer(dest)
    marked.write_text(mark)
    return dest
