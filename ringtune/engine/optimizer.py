"""AdamW with the hyper-parameters of each optim_step call, global grad-norm clipping and its metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from ringtune.errors import UserInputError


@dataclass(frozen=True, kw_only=True)
class AdamParams:
    """Tinker's ``AdamParams`` (same names and defaults as the SDK)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        """UserInputError naming the field, value and limit; checked before anything changes.

        Every field must be a real number (bools and strings are refused), finite and within its range.
        """
        limits = {
            "learning_rate": (lambda v: v >= 0, ">= 0"),
            "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "eps": (lambda v: v > 0, "> 0"),
            "weight_decay": (lambda v: v >= 0, ">= 0"),
            "grad_clip_norm": (lambda v: v >= 0, ">= 0 (0 = off)"),
        }
        for name, (ok, limit) in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise UserInputError(
                    f"adam_params.{name}={value!r} ({type(value).__name__}) must be a real number {limit}"
                )
            if not (math.isfinite(float(value)) and ok(float(value))):
                raise UserInputError(f"adam_params.{name}={value!r} must be finite and {limit}")


def global_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """L2 norm of every gradient together, in float64 (the gradients are already the global SUM)."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return math.sqrt(total)


def adamw_step(
    optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], adam: AdamParams, *, norm: float | None = None
) -> float:
    """Clip to ``adam.grad_clip_norm`` (0 = off), apply AdamW with ``adam``'s hyper-parameters; returns the norm.

    The grad norm reported is the one before clipping: ``norm`` when given (sharded gradients, whose global
    norm needs a collective: :func:`ringtune.engine.sharding.sharded_grad_norm`), else :func:`global_grad_norm`.
    """
    norm = global_grad_norm(params) if norm is None else norm
    if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
        scale = adam.grad_clip_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
