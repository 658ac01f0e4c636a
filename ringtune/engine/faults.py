"""Debug faults for the parity client's negative controls (``ringtune serve --debug-fault NAME``; hidden flag).

Each fault is a deliberate, *silent* CP bug that ``ringtune parity compare`` must catch. They live in one
registry (:data:`DEBUG_FAULTS`) and act through one-line hooks marked ``# DEBUG-FAULT HOOK`` in the code they
break; with no fault active every hook returns its input unchanged (one ``is None`` test).

The active fault is process state, set by :class:`~ringtune.engine.trainer.Trainer` around each microbatch and
optimizer step (:func:`injecting`), because the hooks sit deep in ops that take no trainer argument (rotary,
the chunkwise GDN hand-off, the loss terms). Nothing outside a trainer call ever sees a fault.

=================================  ===========================================================================
``position_off_by_one``            rotary reads positions + 1 for the tokens of zigzag chunk ``C`` of every
                                   sequence (the first chunk of the last CP rank's second half), after
                                   ``PackedShard`` checked the positions against the plan
``gradients_averaged``             the DP×CP-summed gradients are divided by the group size *after* the
                                   gradient invariant passed (a plain average would trip the invariant)
``gdn_state_dropped``              chunkwise GatedDeltaNet: the incoming state handed across a contiguous split
                                   is replaced by zeros (the conv halo still crosses)
``loss_sign_flipped``              the last CP rank's per-token loss terms are negated (their gathered
                                   loss flips; the gradient of that rank's tokens points the wrong way)
``weight_decay_skipped_cp1``       AdamW on CP rank 1 runs with weight decay 0: its replica drifts from the
                                   others after the first step with weight decay (every figure read from rank 0
                                   stays clean; the replica check sees it)
``unscored_backward_skipped``      a CP rank whose share of a microbatch holds no scored token (target pad or
                                   weight 0) drops the parameter gradients of its backward (it still runs the
                                   collectives, so nothing hangs): the gradient its tokens get through the
                                   later tokens of other ranks is lost
``gdn_decay_relayout_bf16``        chunkwise GatedDeltaNet: the log decay ``g`` is moved zigzag -> contiguous
                                   in the input dtype (rounded to bfloat16) instead of float32
``ring_dkv_exchange_bf16``         ring attention backward: the partial dK/dV is rounded to the input dtype at
                                   every hop instead of travelling in the float32 accumulator
``ring_shift_reversed``            ring attention takes the K/V held at step i as rank ``r + i``'s instead of
                                   ``r - i``'s (the blocks and causal masks of the wrong source): identical at
                                   CP=2 (a ring of two has one neighbour), wrong from CP=4
=================================  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

DEBUG_FAULTS = (
    "position_off_by_one",
    "gradients_averaged",
    "gdn_state_dropped",
    "loss_sign_flipped",
    "weight_decay_skipped_cp1",
    "unscored_backward_skipped",
    "gdn_decay_relayout_bf16",
    "ring_dkv_exchange_bf16",
    "ring_shift_reversed",
)
"""Every fault name ``--debug-fault`` accepts."""


@dataclass(frozen=True)
class ActiveFault:
    """The fault injected in the current trainer call, and this rank's place in the CP group."""

    name: str
    cp_size: int
    cp_rank: int
    local_starts: tuple[int, ...] = ()
    chunk_lens: tuple[int, ...] = ()


_ACTIVE: ActiveFault | None = None


def check_fault(name: str | None) -> str | None:
    """``name`` if it is None or in :data:`DEBUG_FAULTS`; ValueError naming the choices otherwise."""
    if name is not None and name not in DEBUG_FAULTS:
        raise ValueError(f"debug fault {name!r} unknown; choose one of {DEBUG_FAULTS}")
    return name


@contextmanager
def injecting(name: str | None, *, cp_size: int, cp_rank: int, plan=None) -> Iterator[None]:
    """Make ``name`` (None: nothing) the active fault for the body; ``plan`` is the microbatch's ZigzagPlan."""
    global _ACTIVE
    if name is None:
        yield
        return
    previous = _ACTIVE
    rows = {} if plan is None else {"local_starts": plan.local_starts, "chunk_lens": plan.chunk_lens}
    _ACTIVE = ActiveFault(check_fault(name), cp_size, cp_rank, **rows)
    try:
        yield
    finally:
        _ACTIVE = previous


def active(name: str) -> bool:
    """Whether fault ``name`` is being injected now."""
    return _ACTIVE is not None and _ACTIVE.name == name


def shift_positions(positions: torch.Tensor) -> torch.Tensor:
    """Hook in rotary: positions + 1 on the local tokens of zigzag chunk ``C`` (``position_off_by_one``)."""
    fault = _ACTIVE
    if fault is None or fault.name != "position_off_by_one" or fault.cp_rank != fault.cp_size - 1:
        return positions
    if positions.shape[0] < sum(2 * c for c in fault.chunk_lens):
        return positions  # not the packed row's stream (e.g. a decode step)
    shifted = positions.clone()
    for start, c in zip(fault.local_starts, fault.chunk_lens, strict=True):
        # Rank C-1 holds chunks C-1 and C of every sequence, back to back: its second c tokens are chunk C.
        shifted[start + c : start + 2 * c] += 1
    return shifted


def scale_reduced_gradients(grads: list[torch.Tensor], group_size: int) -> None:
    """Hook after the gradient invariant: divide the summed gradients by ``group_size`` (``gradients_averaged``)."""
    if active("gradients_averaged") and group_size > 1:
        for g in grads:
            g.div_(group_size)


def gdn_fault(fault: str | None) -> str | None:
    """Hook in chunkwise GDN: its own negative-control ``fault`` argument, or ``drop_state`` when injected."""
    return "drop_state" if active("gdn_state_dropped") else fault


def flip_loss_sign(terms: torch.Tensor) -> torch.Tensor:
    """Hook in the loss: the last CP rank's per-token terms negated (``loss_sign_flipped``)."""
    fault = _ACTIVE
    if fault is None or fault.name != "loss_sign_flipped" or fault.cp_rank != fault.cp_size - 1:
        return terms
    return -terms


def skip_weight_decay(name: str | None, cp_rank: int, optimizer: torch.optim.Optimizer) -> None:
    """Hook before AdamW's step: weight decay 0 on CP rank 1 (``weight_decay_skipped_cp1``), else nothing.

    Takes the trainer's fault name (not the active one): the optimizer runs outside :func:`injecting`.
    """
    if name == "weight_decay_skipped_cp1" and cp_rank == 1:
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.0


def unscored_grads(
    params: list[torch.Tensor], targets: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> list[torch.Tensor | None] | None:
    """Hook before a microbatch's backward (``unscored_backward_skipped``): when this rank's share holds no scored
    token (every local target a pad (< 0) or of weight 0), a copy of every gradient so far; None otherwise."""
    if not active("unscored_backward_skipped"):
        return None
    scored = targets >= 0
    if "weights" in inputs:
        scored = scored & (inputs["weights"] != 0)
    if bool(scored.any()):
        return None
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def skip_unscored_backward(params: list[torch.Tensor], saved: list[torch.Tensor | None] | None) -> None:
    """Hook after the backward: put back the gradients :func:`unscored_grads` saved (this rank's part is lost)."""
    if saved is None:
        return
    for p, g in zip(params, saved, strict=True):
        p.grad = g


def decay_relayout(g: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """Hook before chunkwise GDN's relayout of the log decay: ``g`` rounded to ``input_dtype``
    (``gdn_decay_relayout_bf16``; the float32 values moved through bfloat16), else ``g``."""
    if not active("gdn_decay_relayout_bf16"):
        return g
    return g.to(input_dtype).to(g.dtype)


def dkv_exchange(dkv: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """Hook before each hop of the ring's partial dK/dV: rounded to ``input_dtype`` (``ring_dkv_exchange_bf16``)."""
    if not active("ring_dkv_exchange_bf16"):
        return dkv
    return dkv.to(input_dtype).to(dkv.dtype)


def ring_source(cp_rank: int, step: int, size: int) -> int:
    """Hook in ring attention: the rank whose K/V this rank holds at ``step``: ``(r - step) mod C``, or
    ``(r + step) mod C`` under ``ring_shift_reversed`` (the same at C <= 2)."""
    if active("ring_shift_reversed"):
        return (cp_rank + step) % size
    return (cp_rank - step) % size
