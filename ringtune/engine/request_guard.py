"""All-or-nothing over the mesh: the ranks agree on a request's or an optimizer step's outcome before anything is
kept (:class:`~ringtune.engine.trainer.Trainer`). Collective over the control group
(:mod:`ringtune.parallel.control`: store exchanges, with liveness).

- :func:`settle_request`: after a ``forward(_backward)`` ran its microbatches, every rank's (raised?, datums with
  a non-finite loss, datums after whose microbatch the gradient was non-finite) is gathered; any error, raised
  or non-finite, is raised on every rank alike, and the request's gradients are dropped (the stash restored);
- :func:`step_refusal` / :func:`settle_step`: an optimizer step is refused on every rank when any rank saw a
  non-finite weight, a non-finite gradient norm, or an AdamW update that would leave a weight or moment
  non-finite; the accumulated gradients are then dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ringtune.engine.batch import Batch
from ringtune.engine.grad_stash import GradientStash, drop_gradients
from ringtune.engine.request_outcome import non_finite_error
from ringtune.errors import NonFiniteError
from ringtune.parallel.control import RankFailedError, agree, all_gather_objects


def settle_request(
    error: BaseException | None,
    loss_bad: set[int],
    grad_bad: set[int],
    *,
    batch: Batch,
    forward_only: bool,
    stash: GradientStash | None,
    group: dist.ProcessGroup | None,
    repair: Callable[[], None],
    mark_broken: Callable[[str], None],
) -> None:
    """Return on every rank when the request succeeded everywhere; else raise the agreed error on every rank,
    with the request's gradients dropped (``stash`` restored; None for a forward-only request).

    ``repair()`` runs when some rank raised mid-request (the data groups' sequence numbers no longer match:
    rebuild them). When the ranks cannot even agree (a rank died or hung), ``mark_broken(why)`` is called and
    RankFailedError raised.
    """
    try:
        verdicts = all_gather_objects((error is not None, sorted(loss_bad), sorted(grad_bad)), group)
    except BaseException as exc:  # a rank died or hung: the mesh cannot agree any more
        if stash is not None:
            stash.restore()
        mark_broken(f"the ranks could not agree ({type(exc).__name__}: {exc})")
        raise RankFailedError(f"a rank of the mesh died or hung: {exc}", error_type=type(exc).__name__) from exc
    must_repair = any(raised for raised, _, _ in verdicts)
    if error is None:
        error = non_finite_error(verdicts, batch, forward_only)
    try:
        agree(error, group)
    except BaseException:
        if stash is not None:
            stash.restore()
        if must_repair:
            repair()
        raise


def step_refusal(verdicts: Sequence[tuple[bool, list[str], list[str]]], norm: float) -> NonFiniteError | None:
    """The refusal of an optimizer step from every rank's ``(norm finite, non-finite weights, unsafe updates)``
    (parameter names); None when the step may run. Weights first, then the norm, then the update."""
    weights = sorted({n for _, names, _ in verdicts for n in names})
    updates = sorted({n for _, _, names in verdicts for n in names})
    if weights:
        return NonFiniteError(
            f"optim_step refused: parameter(s) {', '.join(weights[:8])} hold non-finite values (the model is "
            "corrupt; load a checkpoint). Weights, AdamW moments and step unchanged; accumulated gradients dropped."
        )
    if not all(finite for finite, _, _ in verdicts):
        return NonFiniteError(
            f"optim_step refused: the summed gradient's norm is {norm} (not finite). Weights, AdamW moments "
            "and step unchanged; the accumulated gradients were dropped."
        )
    if updates:
        return NonFiniteError(
            f"optim_step refused: the AdamW update of parameter(s) {', '.join(updates[:8])} would make a weight "
            f"or moment non-finite (summed gradient norm {norm:.3g}: an element that large overflows the "
            "second moment; lower the learning rate or clip with grad_clip_norm). Weights, AdamW moments "
            "and step unchanged; the accumulated gradients were dropped."
        )
    return None


def settle_step(
    error: BaseException | None,
    verdict: tuple[bool, list[str], list[str]],
    norm: float,
    *,
    params: Sequence[torch.nn.Parameter],
    invariant,
    group: dist.ProcessGroup | None,
) -> None:
    """Return on every rank when the step may run; else raise the agreed error on every rank (``error`` raised
    here first, else :func:`step_refusal` of every rank's ``verdict``) after dropping the accumulated gradients
    of ``params`` and ``invariant``'s count. Two exchanges over ``group``."""
    verdicts = all_gather_objects(verdict, group)
    if error is None:
        error = step_refusal(verdicts, norm)
    try:
        agree(error, group)
    except BaseException:
        drop_gradients(params, invariant)
        raise
