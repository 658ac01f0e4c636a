"""LoRA on a MoE layer's routed experts: the adapters' delta inside the grouped expert matmuls, and merged.

Hosted Tinker's scheme (:mod:`ringtune.models.lora`, docs/lora.md): ``experts.gate_proj`` / ``experts.up_proj``
have one ``A`` [r, hidden] shared by every expert and a ``B`` [E, I, r] per expert; ``experts.down_proj`` an ``A``
[E, r, I] per expert and one ``B`` [hidden, r] shared. The ``Experts`` module calls the slot's hook on each fused
projection's rows, already grouped by this rank's experts (under EP a rank holds experts ``first ...``, and uses
those rows of the per-expert matrices).
"""

from __future__ import annotations

import torch

from ringtune.models.layers.moe import grouped_linear
from ringtune.models.lora_types import AdapterSet, Target
from ringtune.ops.linear import linear

EXPERT_PROJ = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
"""Each routed-expert adapter and the fused expert tensor it adapts (gate and up are row blocks of gate_up)."""


def expert_delta(
    adapters: AdapterSet,
    module: str,
    proj: str,
    x: torch.Tensor,
    counts: torch.Tensor,
    first: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out`` plus ``adapters``' routed-expert deltas on the rows of ``x`` [n, in], grouped by local expert
    (``counts`` int64 [E_local], experts ``first ...``), for the fused tensor ``proj`` of the ``Experts`` module
    ``module``: ``gate_up_proj`` (``out`` [n, 2I]: gate rows then up rows) or ``down_proj`` (``out``
    [n, hidden]). Per expert e: ``scale · B_e(A(x))`` (gate/up) or ``scale · B(A_e(x))`` (down)."""
    parts = []
    local = counts.shape[0]
    for t in adapters.by_module[module]:
        if EXPERT_PROJ[t.name.rsplit(".", 1)[1]] != proj:
            continue
        a, b = (m.to(x.dtype) for m in adapters.pair(t.name))
        if t.per_expert == "B":
            parts.append(grouped_linear(linear(x, a), b[first : first + local], counts) * adapters.scale)
        else:
            parts.append(linear(grouped_linear(x, a[first : first + local], counts), b) * adapters.scale)
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out + delta.to(out.dtype)


def expert_weight_delta(adapters: AdapterSet, target: Target) -> torch.Tensor:
    """``scale · B_e @ A_e`` of expert adapter ``target`` for every expert: [E, out, in] in float64 (merging)."""
    a, b = (m.detach().double() for m in adapters.pair(target.name))
    return (b @ a if target.per_expert == "B" else b[None] @ a) * adapters.scale
