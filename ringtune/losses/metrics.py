"""The metric dict of a forward_backward result, from the gathered full-length per-datum outputs.

Every key is ``name:reduction`` with exactly one colon (the SDK splits on it when merging chunks):

- ``loss:sum``: the request's loss, the sum of every datum's elementwise loss (always).
- ``clip_frac:mean`` (ppo, cispo, gspo, when logprobs and inputs are given): among tokens with a
  nonzero advantage, the fraction whose ratio (gspo: the datum's sequence ratio) lies outside
  ``[lo, hi]``; 0.0 when no token has a nonzero advantage.
- stable_reinforce (when logprobs and inputs are given), over the sampled rows (``sampled_mask``) of every
  datum, ``q`` the sampler's recorded log-prob and ``lp`` this pass's: ``masked_token_frac:mean`` (ratio
  outside the token band), ``masked_sequence_frac:mean`` (among datums with a sampled row, those whose
  sequence ratio is outside the sequence band), ``kl_sample_train_v1:mean`` (mean of ``q - lp``) and
  ``kl_sample_train_v2:mean`` (mean of ``½(q - lp)²``), the cookbook's two estimates of the sampler/trainer
  divergence, here against the server's own record of the sampler. All 0.0 when no row is sampled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringtune.losses.config import LossConfig
from ringtune.losses.reference import sequence_log_ratio


def loss_metrics(
    config: LossConfig,
    elementwise: Sequence[torch.Tensor],
    logprobs: Sequence[torch.Tensor] | None = None,
    inputs: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """Metrics of one request.

    Args:
        elementwise: per datum, its full-length elementwise loss ([N] or [N, K]), as the engine
            returns it (identical on every CP rank after the gather).
        logprobs: per datum, the full-length lp of this pass ([N]); needed for ``clip_frac:mean``.
        inputs: per datum, its ``loss_fn_inputs``; needed for ``clip_frac:mean``.
    Returns:
        ``{"loss:sum": ...}`` plus ``"clip_frac:mean"`` where it applies.
    """
    total = sum((float(e.detach().double().sum()) for e in elementwise), 0.0)
    metrics = {"loss:sum": total}
    if config.loss_fn == "stable_reinforce" and logprobs is not None and inputs is not None:
        return metrics | stable_reinforce_metrics(config, logprobs, inputs)
    if config.clip_low is None or config.clip_high is None or logprobs is None or inputs is None:
        return metrics
    clipped, counted = 0, 0
    for lp, datum in zip(logprobs, inputs, strict=True):
        lp = lp.detach().double()
        q = datum["logprobs"].double()
        if config.loss_fn == "gspo":
            ratio = sequence_log_ratio(lp, q, datum["sequence_ratio_mask"]).exp().expand_as(lp)
        else:
            ratio = (lp - q).exp()
        lo = datum.get("clip_low_threshold", torch.tensor(config.clip_low, device=lp.device)).double()
        hi = datum.get("clip_high_threshold", torch.tensor(config.clip_high, device=lp.device)).double()
        scored = datum["advantages"] != 0
        counted += int(scored.sum())
        clipped += int((scored & ((ratio < lo) | (ratio > hi))).sum())
    metrics["clip_frac:mean"] = clipped / counted if counted else 0.0
    return metrics


def stable_reinforce_metrics(
    config: LossConfig, logprobs: Sequence[torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, float]:
    """The stable_reinforce metrics of the module docstring (full-length per-datum ``lp`` [N] and inputs)."""
    assert config.token_band is not None and config.sequence_band is not None
    masked_tokens, tokens, masked_seqs, seqs, v1, v2 = 0, 0, 0, 0, 0.0, 0.0
    for lp, datum in zip(logprobs, inputs, strict=True):
        sampled = datum["sampled_mask"] != 0
        if not bool(sampled.any()):
            continue
        diff = (lp.detach().double() - datum["logprobs"].double())[sampled]
        low, high = config.token_band
        ratio = diff.exp()
        masked_tokens += int(((ratio < low) | (ratio > high)).sum())
        tokens += int(diff.numel())
        seq = float(diff.mean().exp())
        seqs += 1
        masked_seqs += int(not config.sequence_band[0] <= seq <= config.sequence_band[1])
        v1 += float((-diff).sum())
        v2 += float((0.5 * diff.square()).sum())
    return {
        "masked_token_frac:mean": masked_tokens / tokens if tokens else 0.0,
        "masked_sequence_frac:mean": masked_seqs / seqs if seqs else 0.0,
        "kl_sample_train_v1:mean": v1 / tokens if tokens else 0.0,
        "kl_sample_train_v2:mean": v2 / tokens if tokens else 0.0,
    }
