"""Gradient reduction over DP×CP with its invariant check (SUM, never a mean, never scaled by microbatches).

Every microbatch loss gets ``+ canary`` (a zero-valued float64 leaf): after backward the canary's gradient
counts the microbatches this rank ran, scaled by whatever scaling the loss path applied. Reduced by the
same function as the gradients, it must equal the total number of microbatches over the DP×CP group,
exactly. Averaging over the group, dividing the loss by the microbatch count, or reducing over the wrong
group all change it, and :meth:`GradientInvariant.check` fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ringtune.engine import faults

FAULTS = (None, "average_over_group", "scale_by_microbatches", "fsdp_default_divide")
"""Fault injection for negative controls only (the last one acts in :mod:`ringtune.engine.sharding`)."""


class GradientInvariantError(RuntimeError):
    """A gradient reduction scaled what must be a plain SUM (a bug, never a user error)."""


def reduce_gradients(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, *, fault: str | None = None) -> None:
    """In place: SUM each tensor over ``group`` (the DP×CP group); None or size 1 = nothing to do."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for t in tensors:
        dist.all_reduce(t, group=group)
        if fault == "average_over_group":
            t /= dist.get_world_size(group)


class GradientInvariant:
    """The canary that proves the gradient path is a plain SUM over microbatches and DP×CP ranks."""

    def __init__(self, group: Callable[[], dist.ProcessGroup | None], *, fault: str | None = None) -> None:
        """``group()`` gives the DP×CP group at the time of each reduction (the mesh may rebuild it)."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self._group = group
        current = group()
        self.group_size = 1 if current is None else dist.get_world_size(current)
        self.fault = fault
        self.canary = torch.zeros((), dtype=torch.float64, requires_grad=True)
        self.expected = 0

    def loss_term(self) -> torch.Tensor:
        """Add this to every microbatch loss, before any scaling (value exactly 0)."""
        return self.canary

    def scale_loss(self, loss: torch.Tensor, microbatches: int) -> torch.Tensor:
        """The loss as backpropagated: itself (a fault may scale it, to show the check catches it)."""
        return loss / microbatches if self.fault == "scale_by_microbatches" else loss

    def count(self, microbatches_per_rank: int) -> None:
        """Record that every rank of the group ran ``microbatches_per_rank`` microbatches."""
        self.expected += microbatches_per_rank * self.group_size

    def take(self) -> tuple[torch.Tensor | None, int]:
        """Set aside what has been accumulated (canary gradient, expected count) and start from zero."""
        saved = (self.canary.grad, self.expected)
        self.canary.grad = None
        self.expected = 0
        return saved

    def restore(self, saved: tuple[torch.Tensor | None, int]) -> None:
        """Drop what was accumulated since :meth:`take` and put ``saved`` back (a refused request)."""
        self.canary.grad, self.expected = saved

    def merge(self, saved: tuple[torch.Tensor | None, int]) -> None:
        """Add ``saved`` (from :meth:`take`) to what was accumulated since (a request that succeeded)."""
        grad, expected = saved
        if grad is not None:
            self.canary.grad = grad if self.canary.grad is None else grad + self.canary.grad
        self.expected += expected

    def reset(self) -> None:
        """Forget everything accumulated (the gradients were dropped)."""
        self.take()

    def reduce_and_check(self, grads: list[torch.Tensor]) -> None:
        """Reduce ``grads`` and the canary together over the group, then require canary == expected."""
        canary = self.canary.grad if self.canary.grad is not None else torch.zeros((), dtype=torch.float64)
        canary = canary.detach().clone()
        reduce_gradients([*grads, canary], self._group(), fault=self.fault)
        got, want = float(canary), float(self.expected)
        self.canary.grad = None
        self.expected = 0
        if got != want:
            raise GradientInvariantError(
                f"gradient invariant violated: the canary summed to {got}, expected {want} (= microbatches x "
                f"DP·CP ranks); a reduction averaged over the group or the loss was scaled by the microbatch count"
            )
        faults.scale_reduced_gradients(grads, self.group_size)  # DEBUG-FAULT HOOK (parity negative control; no-op)

    def startup_check(self) -> None:
        """Run two canary-only microbatches through backward and the reduction; raises if it is not a SUM."""
        for _ in range(2):
            self.scale_loss(self.loss_term(), 2).backward()
        self.count(2)
        self.reduce_and_check([])
