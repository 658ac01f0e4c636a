"""``ringtune plan`` for several base models served together (``ringtune serve --model A --model B``).

Every served model lives on the same ranks (:mod:`ringtune.worker.served_models`) and commands run one at a time,
so a rank holds every model's state at once but runs one model's step at a time. Per layout the set's estimate is:

- summed over the models: parameters, gradients, AdamW moments and sampler snapshots (each model's one full
  fine-tuning run and its samplers, resident together);
- the largest of the models: activations, constants and communication (only one step is in flight).

A layout is planned only when every model allows it (a CP size all their heads take, an EP size every MoE model's
experts divide; a model without experts has EP 1 only, so a set with a dense model has no EP > 1 layouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ringtune.plan.estimate import Estimate
from ringtune.plan.search import Planned, planned_of, ranked

SUMMED = ("parameters", "gradients", "moments", "snapshots")
"""Estimate terms every model holds at once (added up over the set)."""

LARGEST = ("activations", "constants", "communication")
"""Estimate terms of the one step in flight (the largest model's)."""


def combine(estimates: Sequence[Estimate]) -> Estimate:
    """One estimate of the models of ``estimates`` (all of one layout) served together (module docstring);
    ``phase`` and ``detail`` are those of the model with the largest step transient."""
    worst = max(estimates, key=lambda e: sum(getattr(e, t) for t in LARGEST))
    summed = {t: sum(getattr(e, t) for e in estimates) for t in SUMMED}
    largest = {t: max(getattr(e, t) for e in estimates) for t in LARGEST}
    return replace(worst, **summed, **largest)


def plan_model_set(per_model: Sequence[list[Planned]], memory: int) -> list[Planned]:
    """The layouts every model of the set was planned with (``per_model``: each model's :func:`plan_layouts`,
    the same options and ``memory`` bytes per GPU), each with the set's :func:`combine`d estimate, ordered as
    :func:`plan_layouts` orders them (fitting with margin first, then cheapest, then most memory left)."""
    by_layout = [{p.estimate.layout: p.estimate for p in planned} for planned in per_model]
    common = [layout for layout in by_layout[0] if all(layout in m for m in by_layout[1:])]
    return ranked([planned_of(combine([m[layout] for m in by_layout]), memory) for layout in common])
