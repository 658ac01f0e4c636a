"""What one forward(_backward) pass of :meth:`~ringtune.engine.trainer.Trainer.run_batch` runs on and
accumulates into: a model, the parameters whose ``.grad`` it fills, and the gradient invariant(s) counting its
microbatches.

A trainer's own target is its model, its trainable parameters and its invariant. Several LoRA runs batched into
one pass (:mod:`ringtune.engine.lora_batch`) give the lead run's trainer another target: a
:class:`~ringtune.models.lora_mixed.MixedLoraModel` over every run, every run's adapters, and an
:class:`~ringtune.engine.lora_batch.InvariantGroup`; mesh, modes and options stay the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class PassInvariant(Protocol):
    """The part of :class:`~ringtune.engine.gradients.GradientInvariant` a pass drives (its canary in every
    microbatch loss, the microbatch count, and set-aside / restore / merge for all-or-nothing)."""

    def loss_term(self) -> torch.Tensor: ...

    def scale_loss(self, loss: torch.Tensor, microbatches: int) -> torch.Tensor: ...

    def count(self, microbatches_per_rank: int) -> None: ...

    def take(self): ...

    def restore(self, saved) -> None: ...

    def merge(self, saved) -> None: ...


@dataclass(frozen=True)
class PassTarget:
    """``model`` runs the pass (same call signature as :class:`~ringtune.models.decoder.CausalLM`); ``params``
    (its trainable parameters, on this rank) receive the gradients; ``invariant`` counts the microbatches."""

    model: nn.Module
    params: list[torch.nn.Parameter]
    invariant: PassInvariant
