"""LoRA test support: adapters with nonzero weights (a fresh run's ``B = 0`` computes exactly the base, so a
test of what the adapters change would prove nothing)."""

from __future__ import annotations

import torch

from ringtune.models.lora import LoraModel


def randomize_adapters(model: LoraModel, seed: int, std: float = 0.1) -> None:
    """Every ``A`` and ``B`` of ``model`` drawn from N(0, std²) by a generator seeded ``seed`` (in target order,
    float64 then cast: the same values on every rank and in every dtype)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, a, b in model.adapters.named_pairs():
            a.copy_(torch.randn(a.shape, generator=gen, dtype=torch.float64) * std)
            b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float64) * std)
