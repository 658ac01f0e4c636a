"""All-or-nothing gradient accumulation: a request's gradients go into fresh tensors and join the ones
accumulated before it only when every rank agreed that it succeeded (:meth:`Trainer.run_batch`).

Local to this rank (no collective): every rank makes the same choice because the choice follows an agreed
verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringtune.engine.gradients import GradientInvariant


@dataclass
class GradientStash:
    """The ``.grad`` of each parameter before a request (None where there was none) and the gradient
    invariant's canary, set aside while the request accumulates into fresh gradients."""

    params: Sequence[torch.nn.Parameter]
    invariant: GradientInvariant
    saved: list[torch.Tensor | None]
    canary: tuple[torch.Tensor | None, int]

    @classmethod
    def take(cls, params: Sequence[torch.nn.Parameter], invariant: GradientInvariant) -> GradientStash:
        """Set the accumulated gradients aside; every ``.grad`` is None afterwards."""
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        return cls(params, invariant, saved, invariant.take())

    def holds_nothing(self) -> bool:
        """True when nothing was accumulated before the request (no gradient, no canary count): the request's
        gradients will be the whole accumulated gradient."""
        return all(g is None for g in self.saved) and self.canary[0] is None and self.canary[1] == 0

    def restore(self) -> None:
        """The request failed: drop its gradients and put the earlier ones back."""
        for p, old in zip(self.params, self.saved, strict=True):
            p.grad = old
        self.invariant.restore(self.canary)

    def merge(self) -> None:
        """The request succeeded: add its gradients to the earlier ones (in place where there were some)."""
        for p, old in zip(self.params, self.saved, strict=True):
            if old is not None:
                if p.grad is not None:
                    old.add_(p.grad)
                p.grad = old
        self.invariant.merge(self.canary)


def drop_gradients(params: Sequence[torch.nn.Parameter], invariant: GradientInvariant) -> None:
    """Forget every accumulated gradient and the invariant's count (a refused optimizer step)."""
    for p in params:
        p.grad = None
    invariant.reset()
