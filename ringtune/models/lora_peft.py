"""A LoRA run's adapters in the PEFT format: ``adapter_model.safetensors`` + ``adapter_config.json``.

Keys are transformers' module names under PEFT's prefix (``base_model.model.<module>.lora_A.weight`` [r, in],
``...lora_B.weight`` [out, r]) and ``target_modules`` lists the adapted modules by full path, so
``peft`` loads the adapter onto the transformers model of the base (``PeftModel.from_pretrained``) with no
missing or unexpected keys and computes the run's function (``lora_alpha`` / ``r`` as trained; no dropout).

GatedDeltaNet's split adapters (``in_proj_q`` / ``in_proj_k`` / ``in_proj_v`` on row blocks of the fused
``in_proj_qkv``, as Tinker trains them) are written as one exact adapter of rank 3r on ``in_proj_qkv``:
``A = [A_q; A_k; A_v]`` [3r, in] and ``B = blockdiag(B_q, B_k, B_v)`` [out, 3r], so ``B @ A`` stacks the three
deltas; ``rank_pattern`` / ``alpha_pattern`` give that module rank 3r and alpha 3·alpha (the same scale).
The unembedding adapter targets ``lm_head`` (also with tied embeddings: PEFT then adapts the output only).

The routed experts of a MoE layer are PEFT ``target_parameters`` (its ``ParamWrapper`` on transformers' fused
3-D ``experts.gate_up_proj`` [E, 2I, hidden] and ``experts.down_proj`` [E, hidden, I]; PEFT nests the second
wrapper around the first, so the gate/up keys sit under ``experts.base_layer.``). PEFT gives every expert its
own ``A_e`` [r, in] (``lora_A`` [E·r, in], expert-major) and ``B_e`` [out, r] (``lora_B`` [out, r·E],
expert-minor), so the shared halves of ours are repeated per expert: ``gate_up_proj`` is one exact adapter of
rank 2r per expert, ``A_e = [A_gate; A_up]``, ``B_e = blockdiag(B_gate,e, B_up,e)`` (rank and alpha ×2 in the
patterns); ``down_proj`` has ``A_e`` ours and ``B_e = B`` for every e.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ringtune.models.lora import LoraModel, LoraSpec, Target

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."


@dataclass
class PeftLayout:
    """What PEFT needs besides the tensors: the adapted modules and expert parameters (full paths), and the
    rank / alpha of the adapters whose rank is not the run's (fused blocks)."""

    target_modules: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)


def peft_tensors(
    spec: LoraSpec, pairs: Iterable[tuple[Target, torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], PeftLayout]:
    """PEFT's tensors (under their keys) of the adapters ``pairs`` ((target, A, B) as
    :meth:`LoraAdapters.named_pairs` gives them) and its :class:`PeftLayout`. Only cat / block_diag / repeat /
    reshape: differentiable, so a test maps PEFT's gradients back onto ours through this same function."""
    groups: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, a, b in pairs:
        if target.experts:
            experts.setdefault(target.module, {})[target.name.rsplit(".", 1)[1]] = (a, b)
        else:
            groups.setdefault(target.module, []).append((a, b))
    tensors: dict[str, torch.Tensor] = {}
    layout = PeftLayout(target_modules=sorted(groups))
    for module, by_name in experts.items():
        for param, (a, b), inner in _expert_adapters(by_name):
            key = f"{module}.{param}"
            layout.target_parameters.append(key)
            where = f"{PREFIX}{module}.{'base_layer.' if inner else ''}"
            tensors[f"{where}lora_A.weight"], tensors[f"{where}lora_B.weight"] = a, b
            fused = a.shape[0] // by_name["down_proj"][0].shape[0] // spec.rank  # PEFT's rank / ours
            if fused != 1:
                layout.rank_pattern[re.escape(key)] = spec.rank * fused
                layout.alpha_pattern[re.escape(key)] = spec.alpha * fused
    for module, blocks in groups.items():
        if len(blocks) == 1:
            a, b = blocks[0]
        else:  # row blocks of one fused module: an exact adapter of rank len(blocks)·r
            a = torch.cat([p[0] for p in blocks])
            b = torch.block_diag(*[p[1] for p in blocks])
            pattern = re.escape(module)  # peft matches (.*\.)?(pattern)$ against the module path
            layout.rank_pattern[pattern] = a.shape[0]
            layout.alpha_pattern[pattern] = spec.alpha * len(blocks)
        tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"] = a, b
    return tensors, layout


def peft_adapter(lora: LoraModel, *, base_model: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter_config) of ``lora``'s current adapters (CPU copies, the parameters' dtype)."""
    spec = lora.spec
    pairs = [(t, a.detach().cpu(), b.detach().cpu()) for t, a, b in lora.adapters.named_pairs()]
    tensors, layout = peft_tensors(spec, pairs)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": layout.target_modules,
        "target_parameters": layout.target_parameters or None,
        "rank_pattern": layout.rank_pattern,
        "alpha_pattern": layout.alpha_pattern,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    return {k: v.contiguous() for k, v in tensors.items()}, config


def _expert_adapters(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor], bool]]:
    """PEFT's (parameter, (lora_A, lora_B), wrapped inside the other) of one MoE layer's expert adapters
    (``pairs``: ``gate_proj`` / ``up_proj``: A [r, hidden], B [E, I, r]; ``down_proj``: A [E, r, I], B [hidden, r])."""
    (a_g, b_g), (a_u, b_u), (a_d, b_d) = pairs["gate_proj"], pairs["up_proj"], pairs["down_proj"]
    count, rank = a_d.shape[0], a_d.shape[1]
    a_gate_up = torch.cat([a_g, a_u]).repeat(count, 1)  # [E·2r, hidden]: every expert's A_e = [A_g; A_u]
    b_gate_up = torch.stack([torch.block_diag(b_g[e], b_u[e]) for e in range(count)], dim=-1)  # [2I, 2r, E]
    b_down = b_d[:, :, None].expand(-1, -1, count)  # [hidden, r, E]: B_e = B
    return [
        ("gate_up_proj", (a_gate_up, b_gate_up.reshape(b_gate_up.shape[0], 2 * rank * count)), True),
        ("down_proj", (a_d.reshape(count * rank, -1), b_down.reshape(b_down.shape[0], rank * count)), False),
    ]


def write_peft_adapter(lora: LoraModel, path: str | Path, *, base_model: str | None = None) -> None:
    """Write :func:`peft_adapter` into directory ``path`` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, config = peft_adapter(lora, base_model=base_model)
    save_file(tensors, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
