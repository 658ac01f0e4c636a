"""The LoRA types every LoRA module shares: a run's :class:`LoraSpec`, one adapter's :class:`Target`, and
:class:`AdapterSet` (what the routed-expert delta reads of a run's adapters, :class:`~ringtune.models.lora.LoraAdapters`
or several runs' mixed ones). No torch modules and no model imports: :mod:`ringtune.models.lora` and
:mod:`ringtune.models.lora_experts` both import it (docs/lora.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from ringtune.errors import UserInputError

LORA_ALPHA = 32.0
"""``lora_alpha`` of every run (hosted Tinker's, the cookbook's ``lora_alpha: int = 32``); scale = alpha / rank."""

MAX_LORA_RANK = 1024
"""Largest rank accepted."""

UNEMBED = "lm_head"
"""The target name of the unembedding (the log-prob head's weight), tied or not."""

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN_LINEARS = ("in_proj_z", "out_proj")
GDN_SPLIT_QKV = ("in_proj_q", "in_proj_k", "in_proj_v")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """A run's LoRA configuration: the SDK's ``LoraConfig`` (``seed`` fixed by the gateway when absent) + alpha."""

    rank: int
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = LORA_ALPHA

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> LoraSpec:
        """This spec, or UserInputError naming the field, the value and the limit."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_LORA_RANK:
            raise UserInputError(
                f"lora_config.rank={self.rank!r} must be an integer in [1, {MAX_LORA_RANK}] (0: full fine-tuning)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UserInputError(f"lora_config.seed={self.seed!r} must be an integer in [0, 2**63)")
        for name in ("train_attn", "train_mlp", "train_unembed"):
            if not isinstance(getattr(self, name), bool):
                raise UserInputError(f"lora_config.{name}={getattr(self, name)!r} must be a bool")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise UserInputError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise UserInputError(f"lora alpha={self.alpha!r} must be a finite number > 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoraSpec:
        return cls(**values).validate()


@dataclass(frozen=True)
class Target:
    """One adapter: ``name`` (its module path, Tinker's name for a split block), the base ``module`` path it
    hooks, its output rows ``[start, start + out_features)`` of that module, ``in_features``; ``experts`` > 0
    for the routed experts of a MoE layer (``module`` is the ``Experts`` module; one matrix per expert on the
    expert side, :attr:`per_expert`)."""

    name: str
    module: str
    start: int
    out_features: int
    in_features: int
    experts: int = 0

    @property
    def per_expert(self) -> str | None:
        """Which matrix each expert has its own of: ``"B"`` (gate/up: the output is the expert's), ``"A"``
        (down: the input is), None for a plain linear."""
        if not self.experts:
            return None
        return "A" if self.name.endswith(".down_proj") else "B"

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(A's shape, B's shape): ``[r, in]``, ``[out, r]``, with a leading ``[E]`` on the per-expert one."""
        a, b = (rank, self.in_features), (self.out_features, rank)
        if self.per_expert == "A":
            return (self.experts, *a), b
        if self.per_expert == "B":
            return a, (self.experts, *b)
        return a, b

    @property
    def params_per_rank(self) -> int:
        """Adapter parameters per unit of rank (the cookbook's per-rank counts)."""
        a, b = self.shapes(1)
        return math.prod(a) + math.prod(b)


class AdapterSet(Protocol):
    """A run's adapters as :func:`~ringtune.models.lora_experts.expert_delta` reads them."""

    scale: float  # alpha / rank
    by_module: dict[str, list[Target]]  # the targets of each base module path

    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of the adapter called ``name``."""
        ...
