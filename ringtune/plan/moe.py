"""The planner's MoE terms: expert parameters (÷ EP), the MoE MLP's activations and its EP dispatch buffers.

A MoE layer (``cfg.mlp_types[i] == "moe"``) holds, instead of the dense SwiGLU, the router (E·d), the routed
experts (E · 3·d·I_moe: sharded over EP, replicated over the (DP·CP)/EP expert replica ranks, as
:func:`ringtune.models.layers.moe.set_expert_parallel` does) and for Qwen3.5-MoE a shared expert (3·d·I_s + d).
Per token its activations are k routed copies of the SwiGLU inventory (3·I_moe each, compute bytes: gate, up and
their product; ``silu_mul`` recomputes the SiLU) plus the gathered input copy (d) and the shared expert's (3·I_s).
Under EP the dispatch keeps per MoE layer about ``min(k, EP)`` rows of hidden size out and back per token
(``routed_experts_ep``: one row per (token, rank) pair), counted as that layer's communication buffers.
Estimates, checked only against the parameter count so far.
"""

from __future__ import annotations

from ringtune.models.config import DecoderConfig


def is_moe(cfg: DecoderConfig, index: int) -> bool:
    """Whether decoder layer ``index`` has a sparse MoE MLP."""
    return bool(cfg.has_moe) and cfg.mlp_types[index] == "moe"


def dense_mlp_parameters(cfg: DecoderConfig, index: int) -> int:
    """Parameters of layer ``index``'s MLP that every rank holds whole (dense SwiGLU, or router + shared expert)."""
    d = cfg.hidden_size
    if not is_moe(cfg, index):
        return 3 * d * cfg.intermediate_size
    shared = 3 * d * cfg.shared_expert_intermediate_size + d if cfg.shared_expert_intermediate_size else 0
    return cfg.num_experts * d + shared


def expert_parameters(cfg: DecoderConfig, index: int) -> int:
    """Parameters of layer ``index``'s routed experts, all E of them (0 for a dense layer)."""
    return cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size if is_moe(cfg, index) else 0


def mlp_activations(cfg: DecoderConfig, e: int) -> float:
    """Saved bytes per token of a MoE MLP (see the module doc); ``e`` the compute bytes."""
    k = cfg.num_experts_per_tok
    return (3 * k * cfg.moe_intermediate_size + k * cfg.hidden_size + 3 * cfg.shared_expert_intermediate_size) * e


def dispatch_per_token(cfg: DecoderConfig, ep: int, e: int) -> float:
    """EP dispatch buffers per token of one MoE layer's backward: rows out and back, and their gradients."""
    if ep == 1 or not cfg.has_moe:
        return 0.0
    return 4 * min(cfg.num_experts_per_tok, ep) * cfg.hidden_size * e


def ep_sizes(cfg: DecoderConfig, ranks: int) -> list[int]:
    """EP sizes a layout of ``ranks`` DP·CP ranks can use: divisors of ``ranks`` that divide num_experts."""
    if not cfg.has_moe:
        return [1]
    return [n for n in range(1, ranks + 1) if ranks % n == 0 and cfg.num_experts % n == 0]
