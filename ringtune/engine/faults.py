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
=================================  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

DEBUG_FAULTS = ("position_off_by_one", "gradients_averaged", "gdn_state_dropped", "loss_sign_flipped")
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
