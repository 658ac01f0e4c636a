"""One optimizer step of a :class:`~ringtune.engine.trainer.Trainer`, all-or-nothing, in the order it runs.

1. the accumulated gradients are reduced (SUM over DP×CP, invariant-checked; :mod:`ringtune.engine.grad_sync`);
2. their norm and per-tensor bounds, the weights' finiteness and the update guard's figures are read back in one
   host sync (:func:`~ringtune.engine.update_guard.read_step_figures`);
3. the clip factor is set on the optimizer and the parameters whose AdamW update the carried bounds cannot prove
   finite are tried exactly (:func:`~ringtune.engine.update_guard.unsafe_updates`);
4. every rank agrees on the outcome over the control group (:func:`~ringtune.engine.request_guard.settle_step`):
   a refusal raises on every rank with weights, moments and step untouched and the gradients dropped;
5. the update runs (clip + AdamW, taking the replica checksums on its way where the replica check compares);
6. the replicas are compared (:mod:`ringtune.engine.replica_check`) and the step's metrics gathered.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ringtune.engine.grad_sync import GradientSync
from ringtune.engine.gradients import GradientInvariant
from ringtune.engine.memory import peak_memory_bytes
from ringtune.engine.optimizer import AdamParams, prepare_step
from ringtune.engine.replica_check import ReplicaCheck
from ringtune.engine.request_guard import settle_step
from ringtune.engine.state_bounds import StateBounds
from ringtune.engine.update_guard import apply_guarded_step, read_step_figures, unsafe_updates
from ringtune.parallel.control import NOT_CAUGHT, agreed_call, all_gather_objects


class StepOwner(Protocol):
    """What an optimizer step reads and advances: a :class:`~ringtune.engine.trainer.Trainer`'s state (a protocol,
    so that this module does not import the trainer, which imports it)."""

    params: list[torch.nn.Parameter]
    names: dict[int, str]
    optimizer: torch.optim.AdamW
    grad_sync: GradientSync
    state_bounds: StateBounds
    replicas: ReplicaCheck
    invariant: GradientInvariant
    faults: Any  # ringtune.debug_faults.FaultHooks
    shard_params: str
    control_group: dist.ProcessGroup | None
    step: int
    weights_version: int


def run_optim_step(trainer: StepOwner, adam: AdamParams) -> dict[str, float]:
    """Steps 1-6 above on ``trainer`` (a :class:`~ringtune.engine.trainer.Trainer`: its parameters, AdamW state,
    bounds and step count); collective over its data groups and its control group, every rank with the same
    ``adam``. Returns the Tinker metrics of the step (``grad_norm:mean``, ``learning_rate:mean``,
    ``peak_memory_gib:max``, ``step:max``, ``replica_check_ms:max``, ``replica_tensors:max``). Raises as
    :meth:`Trainer.optim_step` documents, on every rank alike.
    """
    t = trainer
    agreed_call(adam.validate, t.control_group)
    norm = math.nan
    error: BaseException | None = None
    bad_weights: list[str] = []
    bad_update: list[str] = []  # parameters whose AdamW update would not be finite (update_guard.unsafe_updates)
    figures, scale = None, 1.0
    try:
        for p in t.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        t.grad_sync.reduce(t.params)
        norm_tensor, grad_bounds = t.grad_sync.norm_and_grad_bounds(t.params)
        figures = read_step_figures(t.params, t.optimizer, norm_tensor, grad_bounds, t.state_bounds)
        norm = figures.norm
        bad_weights = [t.names[id(t.params[i])] for i in figures.non_finite_weights()]
        if math.isfinite(norm) and not bad_weights:  # the clip factor; apply_guarded_step clips
            scale = prepare_step(t.optimizer, adam, norm=norm)
            unsafe = unsafe_updates(t.optimizer, t.params, figures, grad_scale=scale)
            bad_update = [t.names[id(t.params[i])] for i in unsafe]
    except NOT_CAUGHT:
        raise
    except BaseException as exc:
        error = exc
    settle_step(
        error, (math.isfinite(norm), bad_weights, bad_update), norm,
        params=t.params, invariant=t.invariant, group=t.control_group,
    )  # fmt: skip
    t.faults.skip_weight_decay(t.optimizer, t.shard_params)  # DEBUG-FAULT HOOK (no-op without)
    assert figures is not None  # settle_step raised otherwise
    sums = apply_guarded_step(  # the replica checksums where the step took them on its way
        t.state_bounds, t.optimizer, t.params, figures, grad_scale=scale, checksum=t.replicas.compares
    )
    t.step += 1
    t.weights_version += 1
    replica_s = t.replicas.verify(t.params, t.names, t.optimizer, t.step, t.control_group, sums)
    peaks = all_gather_objects(float(peak_memory_bytes()), t.control_group)
    return {
        "grad_norm:mean": norm,
        "learning_rate:mean": float(adam.learning_rate),
        "peak_memory_gib:max": max(peaks) / 2**30,
        "step:max": float(t.step),
        "replica_check_ms:max": 1e3 * replica_s,
        "replica_tensors:max": float(t.replicas.compared),
    }
