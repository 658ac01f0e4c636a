"""Tinker losses on one CP rank's zigzag shard: per-token terms whose sum is the rank's loss.

With ``lp`` = log p(target) of this pass, ``q`` = sampler logprob (``logprobs``), ``A`` = advantage,
``w`` = weight and ``r = exp(lp - q)`` (see docs/protocol.md, "Losses"):

=====================  ==============================================================
cross_entropy          ``-w·lp``  (``w`` any real; ``[T, K]`` lp with ``[T, K]`` weights)
importance_sampling    ``-r·A``  (``[T, K]`` lp with ``[T, K]`` logprobs and advantages)
ppo                    ``-min(r·A, clip(r, lo, hi)·A)``
cispo                  ``-sg(clip(r, lo, hi))·lp·A``
dro                    ``-(lp·A - ½·β·(lp - q)²)``  (no mask: A = 0 tokens keep the penalty)
gspo (GSPO-token)      as ppo with ``r`` replaced by ``s_t = s_d·exp(lp - sg(lp))``, where
                       ``s_d = exp(mean over t in datum d with sequence_ratio_mask != 0 of (sg(lp) - q))``
                       (``s_d = 1`` when the datum marks no token)
stable_reinforce       ``-M_d·m_t·sg(r_t)·lp·A + ½·κ·S_t·(lp - q)²`` on sampled rows ``S_t``
                       (``sampled_mask``): ``m_t`` = 1 when ``r_t`` lies in the token band, ``M_d`` = 1
                       when ``exp(mean over S of (sg(lp) - q))`` lies in the sequence band; 0 off ``S``
=====================  ==============================================================

``lo``/``hi`` come from the config or, token by token, from ``clip_low_threshold`` /
``clip_high_threshold`` inputs; stable_reinforce's bands and ``κ`` (``kl_coef``) from its config
(docs/losses.md). The loss of a request is the plain SUM of these terms over every token of every
datum: under CP each rank sums the terms of its local tokens, and the gradient rule (SUM over
DP×CP) makes the total exact. Only gspo and stable_reinforce mix tokens: ``s_d`` / ``M_d`` need the
whole datum, so the per-datum partial sums are all-reduced over the CP group (one collective per
call, on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ringtune.losses.config import FIXED_GRADIENT_LOSSES, TARGET_K_LOSSES, LossConfig, check_loss_fn
from ringtune.parallel.collectives import all_reduce_


def _get(inputs: Mapping[str, torch.Tensor], key: str, like: torch.Tensor, num_datums: int) -> torch.Tensor:
    if key not in inputs:
        if num_datums == 0:  # a pad-only microbatch: every token is a pad, whose inputs are 0
            return torch.zeros_like(like)
        raise KeyError(f"local_token_losses needs input {key!r} (check_datum_inputs should have caught it)")
    t = inputs[key]
    if t.shape != like.shape:
        raise ValueError(f"input {key!r} has shape {list(t.shape)}, lp has {list(like.shape)}")
    return t.to(device=like.device, dtype=like.dtype)


def _thresholds(
    config: LossConfig, inputs: Mapping[str, torch.Tensor], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): the per-token override tensors where sent, else the config thresholds as 0-d tensors."""
    assert config.clip_low is not None and config.clip_high is not None
    out = []
    for key, default in (("clip_low_threshold", config.clip_low), ("clip_high_threshold", config.clip_high)):
        out.append(_get(inputs, key, like, 1) if key in inputs else like.new_tensor(default))
    return out[0], out[1]


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``-min(ratio·A, clip(ratio, lo, hi)·A)`` elementwise (ppo, and gspo with the sequence ratio)."""
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


def datum_mean_log_ratio(
    lp: torch.Tensor,
    q: torch.Tensor,
    ratio_mask: torch.Tensor,
    datum_index: torch.Tensor,
    num_datums: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Per local token, its datum's ``mean over marked tokens of (sg(lp) - q)`` (0 if none marked).

    Args:
        lp, q, ratio_mask: [T_local] (lp is detached here; no gradient flows through the mean).
        datum_index: int64 [T_local], -1 for pads.
        num_datums: datums in the batch; the partial sums have ``num_datums + 1`` slots (the last
            collects pads), so the collective is the same on every rank even with no local token.
        group: the CP group to SUM the partial sums over (None: single process). Collective.
    Returns:
        [T_local] in lp's dtype (0 at pads). The sums run in float64.
    """
    real = datum_index >= 0
    slot = torch.where(real, datum_index, num_datums)
    marked = (ratio_mask != 0) & real
    diff = torch.where(marked, lp.detach().double() - q.double(), 0.0)
    sums = torch.zeros(2, num_datums + 1, dtype=torch.float64, device=lp.device)
    sums[0].index_add_(0, slot, diff)
    sums[1].index_add_(0, slot, marked.double())
    if group is not None:
        all_reduce_(sums, group)
    mean = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1), 0.0)
    return torch.where(real, mean[slot], 0.0).to(lp.dtype)


def in_band(log_ratio: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    """Bool, elementwise: ``band[0] <= exp(log_ratio) <= band[1]``, compared in log space (low 0: no lower bound)."""
    low, high = band
    above = log_ratio >= math.log(low) if low > 0 else torch.ones_like(log_ratio, dtype=torch.bool)
    return above & (log_ratio <= math.log(high))


def stable_reinforce_terms(
    config: LossConfig,
    lp: torch.Tensor,
    q: torch.Tensor,
    adv: torch.Tensor,
    sampled_mask: torch.Tensor,
    datum_index: torch.Tensor,
    num_datums: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """stable_reinforce's per-token terms (module table) of local tokens; all [T_local]; pads (index -1) give 0.

    ``q``: the sampler's recorded log-probs; ``sampled_mask``: 1 at rows a sampled span covers. Collective: one
    all-reduce over ``group`` (the per-datum sequence ratio), made by every rank.
    """
    assert config.token_band is not None and config.sequence_band is not None and config.kl_coef is not None
    sampled = (sampled_mask != 0) & (datum_index >= 0)
    log_ratio = lp.detach() - q
    log_seq = datum_mean_log_ratio(lp, q, sampled_mask, datum_index, num_datums, group)
    kept = sampled & in_band(log_ratio, config.token_band) & in_band(log_seq, config.sequence_band)
    weight = torch.where(kept, torch.exp(log_ratio), 0.0)
    terms = -weight * lp * adv
    if config.kl_coef:
        terms = terms + torch.where(sampled, 0.5 * config.kl_coef * (lp - q) ** 2, 0.0)
    return terms


def local_token_losses(
    config: LossConfig,
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    *,
    datum_index: torch.Tensor,
    num_datums: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Per-token loss terms of this rank's local tokens; the rank's loss is their ``.sum()``.

    Args:
        config: the request's :class:`LossConfig`.
        lp: float32/float64 [T_local] (or [T_local, K] for cross_entropy): log p(target) of the local
            tokens, in the local (zigzag shard) order; differentiable. Pads may hold any finite value.
        inputs: the per-token client vectors sliced to the same local tokens, pads 0, same leading
            dim as lp (the per-target keys [T_local, K] with [T_local, K] lp). Keys the loss does not use are
            ignored; never modified. With ``num_datums == 0`` (a pad-only microbatch) it may be empty.
        datum_index: int64 [T_local]: the datum (0..num_datums-1) each local token belongs to, -1 for pads.
        num_datums: the number of datums the indices refer to (the same on every rank of the group).
        group: the CP group (None: single process). Only gspo and stable_reinforce talk over it, with one all-reduce
            that every rank makes, whatever its local tokens.
    Returns:
        [T_local] (or [T_local, K]) in lp's dtype, differentiable in lp only, exactly 0 at pads and
        at zero-weight / zero-advantage tokens (except dro's penalty, which has no mask). Always part
        of lp's graph, so a rank with nothing to score still joins the backward.
    """
    loss_fn = check_loss_fn(config.loss_fn)
    if datum_index.shape != lp.shape[:1]:
        raise ValueError(f"datum_index has shape {list(datum_index.shape)}, lp has {list(lp.shape)}")
    if lp.dim() != 1 and not (loss_fn in TARGET_K_LOSSES and lp.dim() == 2):
        raise ValueError(f"lp of shape {list(lp.shape)}: only {TARGET_K_LOSSES} take [T, K] lp, others take [T]")
    real = datum_index >= 0
    if lp.dim() == 2:
        real = real[:, None].expand_as(lp)
    lp = lp.masked_fill(~real, 0.0)  # garbage at pads never reaches a term nor a gradient
    if loss_fn == "cross_entropy":
        terms = -_get(inputs, "weights", lp, num_datums) * lp
        return terms.masked_fill(~real, 0.0)
    q = _get(inputs, "logprobs", lp, num_datums)
    adv = _get(inputs, "advantages", lp, num_datums)
    if loss_fn == "importance_sampling":
        terms = -torch.exp(lp - q) * adv
    elif loss_fn == "ppo":
        terms = clipped_surrogate(torch.exp(lp - q), adv, *_thresholds(config, inputs, lp))
    elif loss_fn == "cispo":
        lo, hi = _thresholds(config, inputs, lp)
        terms = -torch.clamp(torch.exp(lp - q), lo, hi).detach() * lp * adv
    elif loss_fn == "dro":
        assert config.beta is not None
        terms = -(lp * adv - 0.5 * config.beta * (lp - q) ** 2)
    elif loss_fn == "stable_reinforce":
        sampled_mask = _get(inputs, "sampled_mask", lp, num_datums)
        terms = stable_reinforce_terms(config, lp, q, adv, sampled_mask, datum_index, num_datums, group)
    else:  # gspo
        ratio_mask = _get(inputs, "sequence_ratio_mask", lp, num_datums)
        log_s = datum_mean_log_ratio(lp, q, ratio_mask, datum_index, num_datums, group)
        ratio = torch.exp(log_s + lp - lp.detach())  # value s_d, gradient of the token's own lp
        terms = clipped_surrogate(ratio, adv, *_thresholds(config, inputs, lp))
    return terms.masked_fill(~real, 0.0)


def fixed_logprob_gradient(
    config: LossConfig, inputs: Mapping[str, torch.Tensor], *, datum_index: torch.Tensor, like: torch.Tensor
) -> torch.Tensor | None:
    """``d (local_token_losses(...).sum()) / d lp`` when it does not depend on lp, else None.

    Only losses in :data:`FIXED_GRADIENT_LOSSES` (cross_entropy: ``-weights`` at real tokens, 0 at pads).
    Args are those of :func:`local_token_losses`; ``like`` is the local targets tensor ([T_local] or
    [T_local, K]) standing in for lp's shape. Returns float64 of that shape: cast to lp's dtype it is
    exactly the gradient autograd delivers to lp for the loss sum (``-w`` rounded like the loss rounds w).
    """
    if config.loss_fn not in FIXED_GRADIENT_LOSSES:
        return None
    real = datum_index >= 0
    if like.dim() == 2:
        real = real[:, None].expand(like.shape)
    weights = inputs.get("weights")
    if weights is None:  # a pad-only microbatch
        return torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    if weights.shape != like.shape:
        raise ValueError(f"input 'weights' has shape {list(weights.shape)}, lp has {list(like.shape)}")
    return torch.where(real, -weights.to(torch.float64), 0.0)
