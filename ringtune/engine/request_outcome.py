"""What a ``forward`` / ``forward_backward`` request returns, and the error naming the datums that made it
non-finite (:meth:`Trainer.run_batch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringtune.engine.batch import Batch
from ringtune.errors import NonFiniteError


@dataclass(frozen=True)
class ForwardBackwardResult:
    """``outputs[i]`` = {"logprobs", "elementwise_loss"} of datum i (request order), full length ([N] or
    [N, K] like its targets); on the result rank only (None elsewhere). ``metrics`` likewise ({} elsewhere)."""

    outputs: list[dict[str, torch.Tensor]] | None
    metrics: dict[str, float]


def datum_list(indices: list[int], limit: int = 16) -> str:
    """``data[3], data[7] and 2 more``: the first ``limit`` datum indices of an error message."""
    shown = ", ".join(f"data[{i}]" for i in indices[:limit])
    return shown + (f" and {len(indices) - limit} more" if len(indices) > limit else "")


def non_finite_error(verdicts: list, batch: Batch, forward_only: bool) -> NonFiniteError | None:
    """The error naming the datums whose loss (or the gradient after whose microbatch) was not finite.

    ``verdicts``: every rank's ``(raised, datums with a non-finite loss, datums after whose microbatch the
    gradient was non-finite)``, as the ranks gathered them; None when every one is finite.
    """
    loss_bad = sorted({i for _, found, _ in verdicts for i in found})
    grad_bad = sorted({i for _, _, found in verdicts for i in found})
    if not loss_bad and not grad_bad:
        return None
    parts = []
    if loss_bad:
        parts.append(f"non-finite loss or log-probs in {datum_list(loss_bad)}")
    if grad_bad:
        parts.append(f"non-finite gradient after the microbatch of {datum_list(grad_bad)}")
    return NonFiniteError(
        f"{'forward' if forward_only else 'forward_backward'} refused (loss_fn={batch.loss.loss_fn!r}): "
        f"{'; '.join(parts)}; look for huge weights, advantages or logprobs there. Nothing was accumulated."
    )
