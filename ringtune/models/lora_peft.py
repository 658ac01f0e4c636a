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
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ringtune.models.lora import LoraModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."


def peft_adapter(lora: LoraModel, *, base_model: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter_config) of ``lora``'s current adapters (CPU copies, the parameters' dtype)."""
    spec = lora.spec
    groups: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, a, b in lora.adapters.named_pairs():
        groups.setdefault(target.module, []).append((a.detach().cpu(), b.detach().cpu()))
    tensors: dict[str, torch.Tensor] = {}
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for module, pairs in groups.items():
        if len(pairs) == 1:
            a, b = pairs[0]
        else:  # row blocks of one fused module: an exact adapter of rank len(pairs)·r
            a = torch.cat([p[0] for p in pairs])
            b = torch.block_diag(*[p[1] for p in pairs])
            pattern = re.escape(module)  # peft matches (.*\.)?(pattern)$ against the module path
            rank_pattern[pattern] = a.shape[0]
            alpha_pattern[pattern] = spec.alpha * len(pairs)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(groups),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    return tensors, config


def write_peft_adapter(lora: LoraModel, path: str | Path, *, base_model: str | None = None) -> None:
    """Write :func:`peft_adapter` into directory ``path`` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, config = peft_adapter(lora, base_model=base_model)
    save_file(tensors, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
