"""Router statistics of the MoE layers: per-expert load (metrics) and the load-balancing auxiliary loss.

A pure module over the MoE blocks it is given (anything with ``router_stats`` and ``track_probs``, e.g.
``moe_blocks(model)`` of :mod:`ringtune.models.layers.moe`, which imports this module, never the reverse).
Each :class:`~ringtune.models.layers.moe.SparseMoE` forward records, over this rank's **real** tokens (padding
excluded: ``shard.plan.is_real``), ``RouterStats``: the assignments per expert (float64 [E], no gradient), the
summed router probabilities per expert (float [E], differentiable; only when ``track_probs``) and the token count.
Routing is computed on a token's home rank, so summing the counts over every rank of the DP×CP group counts every
token of a request once, whatever CP, DP or EP.

Auxiliary loss (transformers' ``load_balancing_loss_func``, the MoE layers concatenated, over one packed row; off
by default: Tinker's losses have no auxiliary term): ``E · Σ_e f_e · P_e`` with ``f_e = C_e / N`` (C_e the top-k
assignments to expert e over every MoE layer, N = layers × the row's real tokens) and ``P_e = S_e / N`` (S_e the
summed router probabilities). **CP-invariant**: C and N are summed over the CP group first (no gradient flows
through the counts, as in transformers), and each rank adds ``E · Σ_e C_e · S_e^local / N²``, its share of the
row's value; the ranks' gradients then SUM (the Trainer's DP×CP rule) to the full row's gradient exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ringtune.errors import UserInputError
from ringtune.parallel.collectives import all_reduce_


@dataclass
class RouterStats:
    """One MoE forward's statistics over this rank's real tokens (see the module doc)."""

    counts: torch.Tensor  # float64 [E]: assignments per expert (top-k slots), no gradient
    prob_sums: torch.Tensor | None  # [E]: Σ over real tokens of softmax probabilities (differentiable) or None
    tokens: int  # real tokens


class RoutedBlock(Protocol):
    """What this module reads and sets of a MoE block (:class:`~ringtune.models.layers.moe.SparseMoE`)."""

    router_stats: RouterStats | None  # the last forward's (real tokens only)
    track_probs: bool  # record the router probabilities (needed by the aux loss)


def record(
    x_probs: torch.Tensor | None, ids: torch.Tensor, valid: torch.Tensor | None, num_experts: int
) -> RouterStats:
    """``ids`` int64 [T, k], ``valid`` bool [T] or None (every token real), ``x_probs`` [T, E] or None."""
    real = ids if valid is None else ids[valid]
    counts = torch.bincount(real.reshape(-1), minlength=num_experts).to(torch.float64)
    sums = None
    if x_probs is not None:
        sums = (x_probs if valid is None else x_probs[valid]).sum(0)
    return RouterStats(counts=counts, prob_sums=sums, tokens=int(real.shape[0]))


def router_aux_loss(blocks: Sequence[RoutedBlock], cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's share of the row's auxiliary loss over the MoE ``blocks`` of one model, in layer order (float64
    scalar, differentiable); see the module doc.

    Collective over ``cp_group`` (one all-reduce of every layer's counts; every CP rank calls it together after
    the forward of the same row). Needs every block's last forward recorded with ``track_probs``.
    """
    if not blocks:
        return torch.zeros((), dtype=torch.float64, device="cpu")
    stats = [b.router_stats for b in blocks if b.router_stats is not None]
    prob_sums = [s.prob_sums for s in stats if s.prob_sums is not None]
    if len(prob_sums) != len(blocks):
        raise RuntimeError("router_aux_loss: a MoE block has no recorded router probabilities (track_probs off)")
    device = stats[0].counts.device
    counts = torch.stack([s.counts for s in stats]).sum(0)
    local = torch.cat([counts, torch.tensor([float(sum(s.tokens for s in stats))], device=device)])
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        all_reduce_(local, cp_group)
    n = float(local[-1])
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=device)
    sums = torch.stack([p.to(torch.float64) for p in prob_sums]).sum(0)
    return counts.numel() * (local[:-1] * sums).sum() / (n * n)


def load_max_over_mean(counts: torch.Tensor) -> float:
    """max_e C_e / mean_e C_e of per-expert counts [E] (1.0 is perfectly even; 0.0 when nothing was routed)."""
    mean = float(counts.mean())
    return float(counts.max()) / mean if mean > 0 else 0.0


def layer_counts(named_blocks: Sequence[tuple[str, RoutedBlock]]) -> dict[str, torch.Tensor]:
    """{metric prefix ``moe/layer{i}`` (i the decoder layer, the last number of the block's module path): the last
    forward's counts float64 [E] (CPU copy)} of ``named_blocks`` ((module path, MoE block) pairs; a block that
    has not run yet is left out)."""
    out = {}
    for name, block in named_blocks:
        if block.router_stats is not None:
            index = next((p for p in reversed(name.split(".")) if p.isdigit()), name)
            out[f"moe/layer{index}"] = block.router_stats.counts.detach().cpu()
    return out


def add_counts(total: dict[str, torch.Tensor], more: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-layer counts summed (a new dict)."""
    return {k: total.get(k, 0) + v for k, v in more.items()} | {k: v for k, v in total.items() if k not in more}


def load_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``moe/layer{i}/load_max_over_mean:max`` (Tinker metric names end in ``:reduction``) from every rank's
    per-layer counts (summed: each token counted once)."""
    summed: dict[str, torch.Tensor] = {}
    for part in parts:
        summed = add_counts(summed, part)
    return {f"{k}/load_max_over_mean:max": load_max_over_mean(v) for k, v in sorted(summed.items())}


def check_aux_coef(blocks: Sequence[RoutedBlock], coef: float) -> float:
    """``coef`` as a float when finite and >= 0; turns on the probability tracking of the model's MoE ``blocks``
    when > 0.

    Raises UserInputError naming the value otherwise, or for coef > 0 on a model without MoE layers (no blocks).
    """
    value = float(coef)
    if not math.isfinite(value) or value < 0:
        raise UserInputError(f"router_aux_loss_coef must be finite and >= 0; got {coef!r}")
    if value > 0 and not blocks:
        raise UserInputError(f"router_aux_loss_coef={value} needs a MoE model (this one has no MoE layers)")
    for block in blocks:
        block.track_probs = value > 0
    return value
