"""The metric dict of a forward_backward result, from the gathered full-length per-datum outputs.

Every key is ``name:reduction`` with exactly one colon (the SDK splits on it when merging chunks):

- ``loss:sum``: the request's loss, the sum of every datum's elementwise loss (always).
- ``clip_frac:mean`` (ppo, cispo, gspo, when logprobs and inputs are given): among tokens with a
  nonzero advantage, the fraction whose ratio (gspo: the datum's sequence ratio) lies outside
  ``[lo, hi]``; 0.0 when no token has a nonzero advantage.
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
