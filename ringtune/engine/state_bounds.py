"""Upper bounds of every weight's and AdamW moment's max |x|, carried from one optimizer step to the next on the
host, so that the step's finite guard (:mod:`ringtune.engine.update_guard`) reads no weight and no moment in the
usual step.

After a step whose update the guard bounded, the new state is bounded by the guard's own arithmetic
(:func:`~ringtune.engine.update_guard.bounds_after_update`): ``|p'| <= |p|·|1 − lr·wd| + lr/(1 − β1)·|m'|/eps``,
``|m'| <= max(|m|, |g|)``, ``v' <= v + g²``, each widened for the rounding of the dtype. :class:`StateBounds`
keeps them with what identifies the exact state they bound: the tensor object (a weak reference), its local
storage address and element count, and its version counter, which every in-place write bumps (AdamW's own,
``copy_`` of a checkpoint load, ``p[i] = x`` under ``no_grad``). :meth:`StateBounds.lookup` hands a bound back
only for a tensor unchanged since; any other tensor is read again (its exact max |x|). A parameter whose update
was not bounded (its exact trial ran) carries nothing: it is read at the next step.

The bounds grow with every step (by ``lr/(1 − β1)·max|m|/eps`` for the weight, and a few ulps); when one no longer
proves an update safe, the guard reads that parameter's exact maxima before anything else
(:func:`~ringtune.engine.update_guard.unsafe_updates`), so a loose bound costs a read, never a wrong verdict.
"""

from __future__ import annotations

import weakref

import torch

from ringtune.engine.tensor_norms import local

Identity = tuple[int, int, int]
"""(local storage address, element count, version counter) of a tensor."""


def identity(t: torch.Tensor) -> Identity:
    """What a bound of ``t`` was taken for: its local storage address, element count and version counter."""
    x = local(t.detach())
    return x.data_ptr(), x.numel(), x._version


class StateBounds:
    """Host upper bounds of max |x| per tensor, valid while the tensor is unchanged (module docstring). Local to
    this rank; no device work, no collective."""

    def __init__(self) -> None:
        self._bounds: dict[int, tuple[weakref.ref, Identity, float]] = {}

    def record(self, tensors: list[torch.Tensor], bounds: list[float]) -> None:
        """Remember ``bounds[i]`` >= max |tensors[i]| for the tensors' present state (call after the write that
        the bound covers); replaces what was recorded before."""
        self._bounds = {id(t): (weakref.ref(t), identity(t), b) for t, b in zip(tensors, bounds, strict=True)}

    def forget(self) -> None:
        """Drop every bound (e.g. a checkpoint was loaded into the tensors)."""
        self._bounds = {}

    def lookup(self, t: torch.Tensor) -> float | None:
        """The recorded bound of ``t`` if it is the same tensor, at the same storage, unchanged since; else None."""
        seen = self._bounds.get(id(t))
        if seen is None or seen[0]() is not t or seen[1] != identity(t):
            return None
        return seen[2]
