"""The plain single-process Tinker losses over full-length per-datum vectors: the oracle.

Written straight from the formulas (docs/protocol.md, "Losses"), one datum at a
time, sharing no code with :mod:`ringtune.losses.token_losses`; the CP tests compare the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringtune.losses.config import LossConfig, check_loss_fn


def sequence_log_ratio(lp: torch.Tensor, q: torch.Tensor, ratio_mask: torch.Tensor) -> torch.Tensor:
    """gspo's ``log s``: mean of ``sg(lp) - q`` over the tokens with ``ratio_mask != 0`` (0-d; 0 if none)."""
    marked = ratio_mask != 0
    if not bool(marked.any()):
        return lp.new_zeros(())
    return (lp.detach() - q)[marked].mean()


def _thresholds(config: LossConfig, inputs: Mapping[str, torch.Tensor], n: int, like: torch.Tensor):
    assert config.clip_low is not None and config.clip_high is not None
    lo = inputs.get("clip_low_threshold")
    hi = inputs.get("clip_high_threshold")
    lo = like.new_full((n,), config.clip_low) if lo is None else lo.to(like.dtype)
    hi = like.new_full((n,), config.clip_high) if hi is None else hi.to(like.dtype)
    return lo, hi


def _ppo_objective(ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    clipped = torch.maximum(torch.minimum(ratio, hi), lo)
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv
    return torch.where(unclipped_obj <= clipped_obj, unclipped_obj, clipped_obj)


def _stable_reinforce(
    config: LossConfig, lp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor, sampled: torch.Tensor
) -> torch.Tensor:
    """docs/losses.md's stable_reinforce over one datum, in ratio space: masked REINFORCE with importance weights."""
    assert config.token_band is not None and config.sequence_band is not None and config.kl_coef is not None
    ratio = (lp.detach() - q).exp()
    seq_ratio = (lp.detach() - q)[sampled].mean().exp() if bool(sampled.any()) else lp.new_ones(())
    seq_kept = config.sequence_band[0] <= float(seq_ratio) <= config.sequence_band[1]
    token_kept = (ratio >= config.token_band[0]) & (ratio <= config.token_band[1])
    weight = torch.where(sampled & token_kept, ratio, torch.zeros_like(ratio)) * float(seq_kept)
    penalty = 0.5 * config.kl_coef * (lp - q).square() * sampled.to(lp.dtype)
    return -(weight * lp * adv) + penalty


def reference_datum_losses(config: LossConfig, lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The per-token loss terms of one datum.

    Args:
        lp: [N] (or [N, K] for cross_entropy) log p(target), differentiable.
        inputs: the datum's full-length ``loss_fn_inputs`` ([N], weights [N, K] with [N, K] lp).
    Returns:
        [N] (or [N, K]) terms; the datum's loss is their sum.
    """
    loss_fn = check_loss_fn(config.loss_fn)
    if loss_fn == "cross_entropy":
        return -inputs["weights"].to(lp.dtype) * lp
    n = lp.shape[0]
    q = inputs["logprobs"].to(lp.dtype)
    adv = inputs["advantages"].to(lp.dtype)
    if loss_fn == "stable_reinforce":
        return _stable_reinforce(config, lp, q, adv, inputs["sampled_mask"] != 0)
    if loss_fn == "importance_sampling":
        return -(lp - q).exp() * adv
    if loss_fn == "dro":
        assert config.beta is not None
        return -(lp * adv) + 0.5 * config.beta * (lp - q).square()
    lo, hi = _thresholds(config, inputs, n, lp)
    if loss_fn == "cispo":
        weight = torch.maximum(torch.minimum((lp - q).exp(), hi), lo).detach()
        return -(weight * lp * adv)
    if loss_fn == "ppo":
        return -_ppo_objective((lp - q).exp(), adv, lo, hi)
    log_s = sequence_log_ratio(lp, q, inputs["sequence_ratio_mask"])  # gspo
    ratio = log_s.exp() * (lp - lp.detach()).exp()
    return -_ppo_objective(ratio, adv, lo, hi)


def reference_losses(
    config: LossConfig, datums: Sequence[tuple[torch.Tensor, Mapping[str, torch.Tensor]]]
) -> list[torch.Tensor]:
    """:func:`reference_datum_losses` of every ``(lp, inputs)`` datum; the request's loss is the sum of all."""
    return [reference_datum_losses(config, lp, inputs) for lp, inputs in datums]
