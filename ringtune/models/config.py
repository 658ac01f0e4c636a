"""Decoder configuration read from a Hugging Face ``config.json``.

Families: ``qwen3_5_text`` / ``qwen3_5`` (hybrid), ``qwen3_5_moe_text`` / ``qwen3_5_moe`` (hybrid with sparse
MoE MLPs and a shared expert), ``llama``, ``qwen3``, ``qwen3_moe`` (Qwen3 attention with sparse MoE MLPs).
A VL config (``qwen3_5``, ``qwen3_5_moe``) contributes its ``text_config``. Any other ``model_type`` is refused
with an error naming it. The original dict is kept verbatim so a save writes back exactly what was loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringtune.errors import ParallelConfigError, UserInputError
from ringtune.models.vision.config import VisionConfig
from ringtune.ops.cp_modes import check_attention_mode, check_gated_delta_mode

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "llama", "qwen3", "qwen3_moe")
LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "moe")
"""Per-layer MLP kinds: SwiGLU (``layers/mlp.py``) or the sparse MoE block (``layers/moe.py``)."""
VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
"""Configs whose decoder is described by their ``text_config``."""
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")


def _pad_token_id(value: Any, vocab_size: int) -> int | None:
    """The config's ``pad_token_id`` when it names a row of the embedding (else None: no padding row)."""
    if isinstance(value, list):  # some configs list several; transformers' Embedding takes an int
        value = value[0] if value else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return None


def _moe_fields(model_type: str, text: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The MoE fields of :class:`DecoderConfig` (transformers 5.24's defaults where a key is absent)."""
    if model_type not in ("qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe"):
        if not text.get("intermediate_size"):
            raise UserInputError(f"config.intermediate_size={text.get('intermediate_size')!r}: a dense model needs it")
        return {"mlp_types": ("dense",) * num_layers}
    qwen3 = model_type == "qwen3_moe"
    experts = int(text.get("num_experts", text.get("num_local_experts", 128 if qwen3 else 256)))
    top_k = int(text.get("num_experts_per_tok", 8))
    if not 1 <= top_k <= experts:
        raise UserInputError(f"config.num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    if qwen3:  # transformers' Qwen3MoeDecoderLayer: dense where listed in mlp_only_layers or off the sparse step
        step, dense = int(text.get("decoder_sparse_step", 1)), set(text.get("mlp_only_layers") or ())
        mlp_types = tuple("moe" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(num_layers))
        if "dense" in mlp_types and not text.get("intermediate_size"):
            raise UserInputError("config.intermediate_size is needed by the dense layers (mlp_only_layers)")
    else:
        mlp_types = ("moe",) * num_layers
    return {
        "mlp_types": mlp_types,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(text.get("moe_intermediate_size", 768 if qwen3 else 512)),
        "shared_expert_intermediate_size": 0 if qwen3 else int(text.get("shared_expert_intermediate_size", 512)),
        # Qwen3.5-MoE's router always renormalises its top-k; Qwen3-MoE's as its config says (default False).
        "norm_topk_prob": bool(text.get("norm_topk_prob", False)) if qwen3 else True,
        "router_aux_loss_coef": float(text.get("router_aux_loss_coef", 0.001)),
    }


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Everything the decoder modules need; ``family`` is "qwen3_5" (hybrid) or "dense" (Llama, Qwen3, Qwen3-MoE).

    ``mlp_types[i]`` is layer i's MLP ("dense" or "moe"); the ``num_experts`` … ``norm_topk_prob`` fields
    describe the MoE layers (0 / unused when there are none); ``shared_expert_intermediate_size`` > 0 adds
    Qwen3.5-MoE's sigmoid-gated shared expert. ``intermediate_size`` is the dense MLP's (0 when none).
    ``mrope_section``: how Qwen3.5's rotary frequencies split over the (t, h, w) positions of image tokens;
    ``vision``: the vision tower of a VL config (None: text only; :func:`~ringtune.models.checkpoints.hf.load_hf`
    also drops it for a checkpoint that holds no ``model.visual.*`` tensors).
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str | None = None
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    pad_token_id: int | None = None
    mlp_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    vision: VisionConfig | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Parse an HF config dict; a ``qwen3_5`` (VL) config contributes its ``text_config``."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserInputError(f"config.model_type={model_type!r}: supported are {SUPPORTED_MODEL_TYPES}")
        text: dict[str, Any] = dict(hf.get("text_config") or {}) if model_type in VL_MODEL_TYPES else hf
        rope: dict[str, Any] = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise UserInputError(f"rope type {rope.get('rope_type')!r}: only the default rotary is supported")
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        common = {
            "model_type": model_type,
            "vocab_size": int(text["vocab_size"]),
            "hidden_size": int(text["hidden_size"]),
            "intermediate_size": int(text.get("intermediate_size") or 0),
            "num_layers": int(text["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(text.get("num_key_value_heads") or heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            "attention_bias": bool(text.get("attention_bias", False)),
            "pad_token_id": _pad_token_id(text.get("pad_token_id", hf.get("pad_token_id")), int(text["vocab_size"])),
            "hf_config": hf,
            **_moe_fields(model_type, text, int(text["num_hidden_layers"])),
        }
        hybrid = model_type in HYBRID_MODEL_TYPES
        # Dense Llama/Qwen3 rotate every channel; Qwen3.5 rotates a fraction (0.25 unless the config says).
        rotary_factor = (
            float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))) if hybrid else 1.0
        )
        rotary_dim = int(head_dim * rotary_factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise UserInputError(
                f"config: rotary dim = head_dim·partial_rotary_factor = {head_dim}·{rotary_factor} = {rotary_dim} "
                f"must be even and in (0, head_dim={head_dim}]"
            )
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise UserInputError(f"config.hidden_act={act!r}: only silu (SwiGLU) is supported")
        if hybrid:
            n = common["num_layers"]
            layer_types = text.get("layer_types") or [
                "linear_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) else "full_attention"
                for i in range(n)
            ]
            bad = [t for t in layer_types if t not in LAYER_TYPES]
            if len(layer_types) != n or bad:
                raise UserInputError(f"config.layer_types must be {n} of {LAYER_TYPES}; got {layer_types}")
            section = tuple(int(v) for v in rope.get("mrope_section", (11, 11, 10)))
            if len(section) != 3:
                raise UserInputError(f"config rope mrope_section={list(section)} must list 3 sizes (t, h, w)")
            return cls(
                family="qwen3_5",
                partial_rotary_factor=rotary_factor,
                mrope_section=section,  # type: ignore[arg-type]
                vision=VisionConfig.from_hf(hf, text_hidden_size=common["hidden_size"]),
                qk_norm="zero_centered",
                layer_types=tuple(layer_types),
                linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
                linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                **common,
            )
        n = common["num_layers"]
        return cls(
            family="dense",
            qk_norm="plain" if model_type in ("qwen3", "qwen3_moe") else None,
            layer_types=("full_attention",) * n,
            **common,
        )

    @property
    def has_moe(self) -> bool:
        """Whether any layer's MLP is the sparse MoE block."""
        return "moe" in self.mlp_types

    def check_expert_parallel(self, ep_size: int) -> None:
        """Raise ParallelConfigError unless ``ep_size`` >= 1 divides ``num_experts`` (any size fits a dense model)."""
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ParallelConfigError(f"ep={ep_size!r} must be an int >= 1")
        if self.has_moe and self.num_experts % ep_size:
            raise ParallelConfigError(f"ep={ep_size} must divide num_experts={self.num_experts}")

    def check_parallel_modes(self, *, attention: str, gated_delta: str) -> None:
        """Raise ParallelConfigError if a mode name is not in the registry (:mod:`ringtune.ops.cp_modes`)."""
        check_attention_mode(attention)
        check_gated_delta_mode(gated_delta)

    def check_parallel(self, *, cp_size: int, attention: str, gated_delta: str, tp_size: int = 1) -> None:
        """Raise ParallelConfigError (with the numbers) if the heads do not fit the CP modes at ``cp_size``."""
        if cp_size < 1:
            raise ParallelConfigError(f"cp_size={cp_size} must be >= 1")
        self.check_parallel_modes(attention=attention, gated_delta=gated_delta)
        if cp_size == 1:
            return
        if attention == "alltoall":
            for name, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)):
                if value % (cp_size * tp_size):
                    raise ParallelConfigError(
                        f"attention mode alltoall needs {name}={value} divisible by TP·CP={tp_size * cp_size}"
                    )
        if "linear_attention" in self.layer_types and gated_delta == "headwise":
            for name, value in (
                ("linear_num_key_heads", self.linear_num_key_heads),
                ("linear_num_value_heads", self.linear_num_value_heads),
            ):
                if value % (cp_size * tp_size):
                    raise ParallelConfigError(
                        f"gated_delta mode headwise needs {name}={value} divisible by TP·CP={tp_size * cp_size}; "
                        "use chunkwise"
                    )
