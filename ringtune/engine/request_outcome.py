"""What a ``forward`` / ``forward_backward`` request returns: a gathered row's per-datum outputs, their collection
onto the result rank, and the error naming the datums that made it non-finite (:meth:`Trainer.run_batch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtune.engine.batch import Batch
from ringtune.errors import NonFiniteError
from ringtune.parallel.control import gather_object_to


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


def split_row(full: torch.Tensor, row: tuple[int, ...], lens: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """{datum index: {"logprobs", "elementwise_loss"}} of a gathered row ``full`` ``[T, 2]`` / ``[T, K, 2]``
    (float64, on the host; its datums back to back in ``row`` order, ``lens`` tokens each); copies."""
    out, start = {}, 0
    for i, n in zip(row, lens, strict=True):
        piece = full[start : start + n]
        out[i] = {"logprobs": piece[..., 0].clone(), "elementwise_loss": piece[..., 1].clone()}
        start += n
    return out


def non_finite_datums(full: torch.Tensor, row: tuple[int, ...], lens: list[int]) -> set[int]:
    """The datums of ``row`` with a non-finite log-prob or loss term in ``full`` (as :func:`split_row` reads it),
    from one count per datum read back together."""
    total = sum(lens)
    bad = (~torch.isfinite(full[:total].flatten(start_dim=1)).all(dim=-1)).to(torch.int64)
    sizes = torch.tensor(lens, dtype=torch.int64, device=full.device)
    ends = sizes.cumsum(0)
    counts = torch.cat([torch.zeros(1, dtype=torch.int64, device=full.device), bad.cumsum(0)])
    per_datum = (counts[ends] - counts[ends - sizes]).tolist()
    return {i for i, k in zip(row, per_datum, strict=True) if k}


def collect_outputs(
    mine: dict[int, dict[str, torch.Tensor]], batch: Batch, dp_size: int, group: dist.ProcessGroup | None
) -> ForwardBackwardResult:
    """Per-datum outputs of every DP group onto the result rank (one gather over the control ``group``; ``mine``
    is {} on every rank but CP rank 0 of each DP group), with the request's metrics; empty elsewhere."""
    parts = gather_object_to(mine, group, dst=0)
    if parts is None:
        return ForwardBackwardResult(outputs=None, metrics={})
    merged: dict[int, dict[str, torch.Tensor]] = {}
    for part in parts:
        merged.update(part)
    outputs = [merged[i] for i in range(len(batch.datums))]
    loss = sum(float(o["elementwise_loss"].sum()) for o in outputs)
    metrics = {
        "loss:sum": loss,
        "num_tokens:sum": float(batch.num_tokens),
        "microbatches:sum": float(batch.plan.microbatches_per_rank * dp_size),
    }
    return ForwardBackwardResult(outputs=outputs, metrics=metrics)
