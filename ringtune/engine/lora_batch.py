"""Several LoRA runs' forward(_backward) requests as one pass over their shared base (multi-adapter batching).

The requests must share a loss (``loss_fn`` and its config) and ``forward_only``; the gateway groups only such
requests (:mod:`ringtune.gateway.passes`). Their datums are packed into one :class:`Batch` whose
``adapter_of_datum`` says each datum's run; the first run's trainer runs it (:meth:`Trainer.run_batch` with a
:class:`~ringtune.engine.pass_target.PassTarget`) on a :class:`~ringtune.models.lora_mixed.MixedLoraModel`,
accumulating each run's adapter gradients into that run's own ``.grad`` (all-or-nothing, like one request) and
counting the microbatches on every run's gradient invariant, so each run's later ``optim_step`` is its own,
unchanged.

Contract: each run gets what it would get alone. A request that is invalid on its own gets its own
UserInputError and the others run without it. If the shared pass is refused as a whole (a non-finite loss
or gradient of one run's datum, or the joined request over a limit), nothing was changed on any rank, and
each request is run alone, so one client's error is never another's. A run with adapters on routed experts
runs alone (its rows are grouped by expert, not by run). Collective over the mesh, like
:meth:`Trainer.forward_backward`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ringtune.engine.gradients import GradientInvariant
from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.pass_target import PassTarget
from ringtune.engine.request_outcome import ForwardBackwardResult
from ringtune.errors import UserInputError
from ringtune.models.lora_mixed import MixedLoraModel
from ringtune.parallel.control import agreed_call

PassResult = ForwardBackwardResult | UserInputError
"""One request's share of a pass: its outputs and metrics, or the UserInputError it got."""


class InvariantGroup:
    """The gradient invariants of the runs of one pass, driven as one by :meth:`Trainer.run_batch` and
    :class:`~ringtune.engine.grad_stash.GradientStash`: every run's canary is in every microbatch's loss (its
    gradient counts the microbatches, as alone), and every run counts them."""

    def __init__(self, invariants: Sequence[GradientInvariant]) -> None:
        self.invariants = list(invariants)

    def loss_term(self) -> torch.Tensor:
        return sum((inv.loss_term() for inv in self.invariants[1:]), self.invariants[0].loss_term())

    def scale_loss(self, loss: torch.Tensor, microbatches: int) -> torch.Tensor:
        return self.invariants[0].scale_loss(loss, microbatches)

    def count(self, microbatches_per_rank: int) -> None:
        for inv in self.invariants:
            inv.count(microbatches_per_rank)

    def take(self) -> list[tuple[torch.Tensor | None, int]]:
        return [inv.take() for inv in self.invariants]

    def restore(self, saved: list[tuple[torch.Tensor | None, int]]) -> None:
        for inv, part in zip(self.invariants, saved, strict=True):
            inv.restore(part)

    def merge(self, saved: list[tuple[torch.Tensor | None, int]]) -> None:
        for inv, part in zip(self.invariants, saved, strict=True):
            inv.merge(part)


def forward_backward_many(
    trainers: Sequence[LoraTrainer],
    data: Sequence[Sequence[Any]],
    loss_fn: str,
    loss_config: Mapping[str, Any] | None = None,
    *,
    forward_only: bool = False,
) -> list[PassResult]:
    """Run ``data[i]`` on ``trainers[i]`` for every i, in one pass where possible (see the module docstring).

    Args:
        trainers: distinct LoRA runs of this rank on one shared base (same mesh and options).
        data: one request's datums per run.
    Returns:
        per run, its :class:`ForwardBackwardResult` (outputs and metrics on the result rank only; the metrics
        add ``lora_pass_runs:max``, the number of runs that shared the pass) or its UserInputError.
    Raises RankFailedError as :meth:`Trainer.forward_backward` does; ValueError for runs that are not distinct
    LoRA runs of one base (a gateway bug).
    """
    if len(trainers) != len(data) or not trainers:
        raise ValueError(f"forward_backward_many: {len(trainers)} trainers for {len(data)} requests")
    if len({id(t) for t in trainers}) != len(trainers):
        raise ValueError("forward_backward_many: a run appears twice")
    lead = trainers[0]
    for trainer in trainers:
        trainer._check_usable()

    def check_each() -> list[UserInputError | None]:
        errors: list[UserInputError | None] = []
        for trainer, datums in zip(trainers, data, strict=True):
            try:
                trainer.build_batch(datums, loss_fn, loss_config)
                errors.append(None)
            except UserInputError as exc:
                errors.append(exc)
        return errors

    errors = agreed_call(check_each, lead.control_group)
    good = [i for i, error in enumerate(errors) if error is None]
    results: list[PassResult | None] = list(errors)

    def alone(i: int) -> PassResult:
        try:
            return trainers[i].forward_backward(data[i], loss_fn, loss_config, forward_only=forward_only)
        except UserInputError as exc:
            return exc

    for i in [i for i in good if trainers[i].lora.adapters.has_experts]:  # their rows group by expert: alone
        results[i] = alone(i)
        good.remove(i)
    if len(good) <= 1:
        for i in good:
            results[i] = alone(i)
        return results  # type: ignore[return-value]
    joined = [datum for i in good for datum in data[i]]
    tags = tuple(k for k, i in enumerate(good) for _ in data[i])
    runs = [trainers[i] for i in good]
    try:
        batch = agreed_call(lambda: lead.build_batch(joined, loss_fn, loss_config), lead.control_group)
        target = PassTarget(
            model=MixedLoraModel([t.lora for t in runs]),
            params=[p for t in runs for p in t.params],
            invariant=InvariantGroup([t.invariant for t in runs]),
        )
        shared = lead.run_batch(replace(batch, adapter_of_datum=tags), forward_only=forward_only, target=target)
    except UserInputError:  # refused as a whole, nothing changed: each request alone gets its own verdict
        for i in good:
            results[i] = alone(i)
        return results  # type: ignore[return-value]
    start = 0
    for i in good:
        n = len(data[i])
        results[i] = _share(shared, batch.datums[start : start + n], start, len(good))
        start += n
    return results  # type: ignore[return-value]


def _share(shared: ForwardBackwardResult, datums: Sequence[Any], start: int, runs: int) -> ForwardBackwardResult:
    """One run's part of the pass's result: its datums' outputs, its loss and tokens, the pass's other metrics."""
    if shared.outputs is None:
        return ForwardBackwardResult(outputs=None, metrics={})
    outputs = shared.outputs[start : start + len(datums)]
    metrics = {
        **shared.metrics,
        "loss:sum": sum(float(o["elementwise_loss"].sum()) for o in outputs),
        "num_tokens:sum": float(sum(d.num_tokens for d in datums)),
        "lora_pass_runs:max": float(runs),
    }
    return ForwardBackwardResult(outputs=outputs, metrics=metrics)
