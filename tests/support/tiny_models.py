"""Tiny random transformers models (Qwen3.5 hybrid, Llama, Qwen3, Qwen3-MoE, Qwen3.5-MoE) and packed token rows.

Sizes are chosen so CP 2 and 4 fit every mode that can: 4 GDN key heads / 8 value heads, 4 attention
heads / 2 kv heads (all-to-all then works at CP 2 only), a rotary dim of 4 (Qwen3.5's partial rotary).
MoE models have 8 experts, top-2, and routers drawn at a scale (std 0.5, logits of std ~3) at which
neighbouring tokens really pick different experts (transformers' zero-initialised router would not).
"""

from __future__ import annotations

import torch

from ringtune.models.logprob_head import IGNORE_INDEX

FAMILIES = ("qwen3_5", "llama", "qwen3", "qwen3_moe", "qwen3_5_moe")

# Packed row of many datums: 1-17-token ones, lengths not divisible by 2C, one longer than a chunk.
LENGTHS = (1, 2, 17, 5, 40, 3, 1, 9)


def hf_config(family: str, **overrides):
    """A transformers config of ``family`` (one of :data:`FAMILIES`), 4 layers, vocab 96; ``overrides``
    replace its fields (e.g. ``mlp_only_layers=[]``: a Qwen3-MoE with no dense layer)."""
    config = _hf_config(family)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"hf_config({family!r}): no field {key!r}")
        setattr(config, key, value)
    return config


def _hf_config(family: str):
    import transformers

    common = {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
    }
    hybrid = {
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **hybrid, tie_word_embeddings=True)
    if family == "qwen3_5_moe":
        common.pop("intermediate_size")
        return transformers.Qwen3_5MoeTextConfig(
            **common, **hybrid, **moe, shared_expert_intermediate_size=24, tie_word_embeddings=True
        )
    if family == "qwen3_moe":  # layer 2 dense (mlp_only_layers), the others sparse
        return transformers.Qwen3MoeConfig(
            **common, **moe, norm_topk_prob=True, mlp_only_layers=[2], tie_word_embeddings=False, rope_theta=10000.0
        )
    if family == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
    raise ValueError(f"family must be one of {FAMILIES}; got {family!r}")


def hf_model(family: str, *, seed: int, **overrides):
    """A random transformers causal LM of ``family`` (config :func:`hf_config` with ``overrides``), with every
    norm weight randomised (not all ones/zeros) and MoE routers drawn at std 0.5 (routing that differs per
    token)."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    cls = {
        "qwen3_5": transformers.Qwen3_5ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
    }[family]
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-3.0, 1.0, p.numel()))
    return model


def packed_tokens(lens: tuple[int, ...], vocab: int, *, seed: int) -> torch.Tensor:
    """int64 [sum(lens)] random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (sum(lens),), generator=gen)


def hf_row_logprobs(model, ids: torch.Tensor, labels: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
    """float32 [T]: the log-probs of ``labels`` along the packed row ``ids`` by a transformers ``model`` run one
    sequence at a time (the plain reference of the packed, CP-sharded forward); 0 where a label is ignored.
    Differentiable (the caller decides on ``no_grad``)."""
    ref, start = [], 0
    for n in lens:
        logp = model(input_ids=ids[start : start + n][None]).logits[0].float().log_softmax(-1)
        lab = labels[start : start + n]
        ref.append(torch.where(lab >= 0, logp.gather(-1, lab.clamp(min=0)[:, None])[:, 0], 0.0))
        start += n
    return torch.cat(ref)


def next_token_labels(ids: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
    """int64 [T]: the next token inside each sequence of the packed row, IGNORE_INDEX at each one's last token."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    start = 0
    for n in lens:
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    return labels
