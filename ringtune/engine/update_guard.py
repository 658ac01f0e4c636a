"""The optimizer step's finite guard without copying the model, and in the usual step without reading it: which
parameters hold non-finite weights, and which AdamW updates could make a weight or moment non-finite, from a few
fused reductions read back once.

:func:`read_step_figures` stacks the gradient norm and, per parameter, upper bounds of max |gradient| (its exact
max, or the gradient's own L2 norm from the norm's sweep) and of max |weight|, max |first moment| and max |second
moment| (this rank's local shards): the bounds the previous step left (:mod:`ringtune.engine.state_bounds`, valid
while the tensor is unchanged) or, for any other tensor, its exact maximum (``torch._foreach_norm`` with
``ord=inf`` on CUDA, ``aminmax`` on CPU, which propagate NaN and inf), into one float64 vector read with one host
sync.

:func:`unsafe_updates` then bounds every element of AdamW's update from those figures on the host, in float64,
following torch's AdamW arithmetic (decoupled weight decay ``p·(1 − lr·wd)``; ``m ← lerp(m, g, 1 − β1)``;
``v ← β2·v + (1 − β2)·g·g``; ``p ← p − lr/(1 − β1^t) · m / (√v/√(1 − β2^t) + eps)``), with the bias corrections
at their worst (t = 1) so no step count is read. Every intermediate and result is bounded by :data:`HEADROOM`
times the dtype's largest finite value; a parameter whose bound holds cannot overflow (its trial would pass).
A parameter whose carried bounds do not hold is read exactly first; only those whose exact figures fail too (a
huge gradient, learning rate or moment; eps below the dtype's smallest normal) get the exact trial of
:func:`ringtune.engine.optimizer.non_finite_update` on copies, so the refusals are the trial's, and the usual
step copies nothing and reads no weight or moment. After the step, :func:`carry_bounds` records the bounds of the
new state (:func:`bounds_after_update`) for the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ringtune.engine.optimizer import apply_step, non_finite_update
from ringtune.engine.state_bounds import StateBounds
from ringtune.engine.tensor_norms import local, max_abs

HEADROOM = 0.25
"""Fraction of the dtype's largest finite value every bounded quantity must stay under (covers the rounding of
each operation, and kernels that order the operations differently: fused, foreach, per tensor)."""

ROUNDING_SLACK_ULPS = 8
"""A carried bound is widened by this many of the dtype's epsilons per step (the few roundings of one update)."""


@dataclass
class StepFigures:
    """What the guard reads back, once: the global gradient norm and this rank's per-parameter upper bounds of
    max |x| (float64 host numbers, in ``params`` order; a missing moment counts 0). ``carried[i]``: some of
    parameter i's weight / moment figures are bounds carried from the previous step rather than its exact maxima
    (:func:`unsafe_updates` replaces them by the exact ones when they do not prove the update safe)."""

    norm: float
    weights: list[float]
    grads: list[float]
    exp_avg: list[float]
    exp_avg_sq: list[float]
    carried: list[bool]

    def non_finite_weights(self) -> list[int]:
        """Indices of the parameters holding a NaN or an inf (a carried bound is finite: its weight is)."""
        return [i for i, w in enumerate(self.weights) if not math.isfinite(w)]


def _moments(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], key: str) -> list[torch.Tensor]:
    """Each parameter's moment ``key`` (the optimizer's tensor: a DTensor under FSDP), or an empty tensor where
    AdamW has none yet."""
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.append(state[key] if key in state else torch.zeros(0, device=local(p.detach()).device))
    return out


def _state_tensors(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
    """The weights, first and second moments, as three lists in ``params`` order."""
    return [list(params), _moments(optimizer, params, "exp_avg"), _moments(optimizer, params, "exp_avg_sq")]


def read_step_figures(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    norm: torch.Tensor,
    grad_maxima: torch.Tensor | None = None,
    known: StateBounds | None = None,
) -> StepFigures:
    """One host sync for the step's guard: ``norm`` (a float64 0-d device tensor, from the gradient sync) and
    upper bounds of max |x| of every local weight, gradient (None counts 0) and AdamW moment. ``grad_maxima``:
    per-parameter bounds of the gradients already taken (float64 ``[len(params)]`` on ``norm``'s device: their
    maxima, or their L2 norms from the norm's sweep, e.g. :meth:`~ringtune.engine.grad_sync.GradientSync.
    norm_and_grad_bounds`); None: their maxima, taken here. ``known``: bounds carried from the previous step, used
    for the tensors unchanged since; every other weight and moment is read here (one fused pass over those).
    None: every one is read (the figures are then the exact maxima)."""
    device = norm.device
    n = len(params)
    if grad_maxima is None:
        grads = [local(p.grad) if p.grad is not None else torch.zeros(0, device=device) for p in params]
        grad_maxima = max_abs(grads, device)
    kinds = _state_tensors(optimizer, params)
    carried = [[None if known is None else known.lookup(t) for t in tensors] for tensors in kinds]
    unread = [
        [local(t.detach()) for t, c in zip(tensors, cs, strict=True) if c is None]
        for tensors, cs in zip(kinds, carried, strict=True)
    ]
    parts = [norm.reshape(1).to(torch.float64), grad_maxima.to(device, torch.float64)]
    parts += [max_abs(tensors, device) for tensors in unread]
    values = torch.cat(parts).tolist()
    norm_value, grads, rest = values[0], values[1 : 1 + n], iter(values[1 + n :])
    weights, exp_avg, exp_avg_sq = ([next(rest) if c is None else c for c in cs] for cs in carried)
    was_carried = [any(cs[i] is not None for cs in carried) for i in range(n)]
    return StepFigures(norm_value, weights, grads, exp_avg, exp_avg_sq, was_carried)


def _update_terms(
    weight: float, grad: float, exp_avg: float, exp_avg_sq: float, group: dict
) -> tuple[list[float], tuple[float, float, float]]:
    """Every intermediate of AdamW's update bounded in real arithmetic, and the bounds of the new max |weight|,
    max |m| and max |v|, from the old ones and max |gradient| (after clipping); bias corrections at t = 1."""
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decay = abs(1.0 - lr * wd)
    m_max = max(exp_avg, grad)  # the new m is a convex combination of m and g; g − m is within m_max + grad
    v_max = exp_avg_sq + grad * grad  # β2·v + (1 − β2)·g·g, the product g·g formed first
    step_size = lr / (1.0 - beta1) if beta1 < 1 else math.inf  # lr / (1 − β1^t), largest at t = 1
    denom = math.sqrt(v_max) / math.sqrt(1.0 - beta2) + eps  # √v / √(1 − β2^t) + eps, largest at t = 1
    ratio = m_max / eps  # m / denom, denom >= eps
    new_weight = weight * decay + step_size * ratio
    terms = [decay, weight * decay, exp_avg + grad, grad * grad, v_max, denom, step_size, step_size * m_max, ratio]
    return [*terms, new_weight], (new_weight, m_max, v_max)


def update_is_bounded(
    *, weight: float, grad: float, exp_avg: float, exp_avg_sq: float, group: dict, dtype: torch.dtype
) -> bool:
    """Whether AdamW with ``group``'s settings certainly keeps every element of a ``dtype`` parameter and its
    moments finite, given (bounds of) max |weight|, max |gradient| (after clipping) and max |moment| (float64 host
    numbers). False also for NaN / inf inputs (every comparison with NaN is False)."""
    if float(group["eps"]) < torch.finfo(dtype).tiny:  # eps rounds to a subnormal or 0: no bound on m / denom
        return False
    limit = HEADROOM * torch.finfo(dtype).max
    terms, _ = _update_terms(weight, grad, exp_avg, exp_avg_sq, group)
    return all(x <= limit for x in terms)


def bounds_after_update(
    *, weight: float, grad: float, exp_avg: float, exp_avg_sq: float, group: dict, dtype: torch.dtype
) -> tuple[float, float, float]:
    """Upper bounds of max |weight|, max |m| and max |v| after one AdamW update that :func:`update_is_bounded`
    passed with the same arguments: the real-arithmetic bounds widened by :data:`ROUNDING_SLACK_ULPS` of
    ``dtype``'s epsilon for the update's roundings."""
    _, new = _update_terms(weight, grad, exp_avg, exp_avg_sq, group)
    slack = 1.0 + ROUNDING_SLACK_ULPS * torch.finfo(dtype).eps
    return new[0] * slack, new[1] * slack, new[2] * slack


def _bounded(figures: StepFigures, i: int, group: dict, dtype: torch.dtype, grad_scale: float) -> bool:
    return update_is_bounded(
        weight=figures.weights[i], grad=figures.grads[i] * grad_scale, exp_avg=figures.exp_avg[i],
        exp_avg_sq=figures.exp_avg_sq[i], group=group, dtype=dtype,
    )  # fmt: skip


def _read_exact(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], figures: StepFigures, indices: list[int]
) -> None:
    """Replace the carried figures of ``params[indices]`` by their exact maxima (one fused pass over those
    tensors, one host sync)."""
    chosen = [params[i] for i in indices]
    kinds = _state_tensors(optimizer, chosen)
    device = local(chosen[0].detach()).device
    values = torch.cat([max_abs([local(t.detach()) for t in tensors], device) for tensors in kinds]).tolist()
    k = len(indices)
    for j, i in enumerate(indices):
        figures.weights[i], figures.exp_avg[i], figures.exp_avg_sq[i] = values[j], values[k + j], values[2 * k + j]
        figures.carried[i] = False


def unsafe_updates(
    optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], figures: StepFigures, *, grad_scale: float
) -> list[int]:
    """Indices into ``params`` whose AdamW update, on the gradients times ``grad_scale`` (the clipping factor of
    :func:`~ringtune.engine.optimizer.prepare_step`), would put a non-finite value in the weight or a moment
    (changes no tensor). Bounded parameters pass on the host; a parameter whose carried figures do not bound it is read
    exactly first (``figures`` updated in place; one more host sync); the rest get the exact trial on copies (its
    extra memory: three copies of the largest such parameter, and one more host sync)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    doubtful = []
    for i, p in enumerate(params):
        if p.grad is not None and id(p) in group_of and not _bounded(figures, i, group_of[id(p)], p.dtype, grad_scale):
            doubtful.append(i)
    loose = [i for i in doubtful if figures.carried[i]]
    if loose:
        _read_exact(optimizer, params, figures, loose)
        doubtful = [
            i for i in doubtful if not _bounded(figures, i, group_of[id(params[i])], params[i].dtype, grad_scale)
        ]
    if not doubtful:
        return []
    return non_finite_update(optimizer, params, only=set(doubtful), grad_scale=grad_scale)


def planned_bounds(
    optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], figures: StepFigures, *, grad_scale: float
) -> list[tuple[int, tuple[float, float, float]]]:
    """Before :func:`~ringtune.engine.optimizer.apply_step` runs the update that ``figures`` guarded (after
    :func:`unsafe_updates`): per parameter that has a gradient and whose update is bounded, its index and the
    bounds of its new max |weight|, |m|, |v| (:func:`bounds_after_update`); the others (no gradient: AdamW leaves
    it alone; not bounded: its exact trial ran) are left out, so the next step reads them."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    planned = []
    for i, p in enumerate(params):
        group = group_of.get(id(p))
        if p.grad is None or group is None or not _bounded(figures, i, group, p.dtype, grad_scale):
            continue
        new = bounds_after_update(
            weight=figures.weights[i], grad=figures.grads[i] * grad_scale, exp_avg=figures.exp_avg[i],
            exp_avg_sq=figures.exp_avg_sq[i], group=group, dtype=p.dtype,
        )  # fmt: skip
        planned.append((i, new))
    return planned


def carry_bounds(
    known: StateBounds,
    optimizer: torch.optim.AdamW,
    params: list[torch.nn.Parameter],
    planned: list[tuple[int, tuple[float, float, float]]],
) -> None:
    """After :func:`~ringtune.engine.optimizer.apply_step`: record ``planned`` (from :func:`planned_bounds`) in
    ``known`` against the parameters' new weights and moments, replacing what it held."""
    tensors: list[torch.Tensor] = []
    bounds: list[float] = []
    for i, new in planned:
        state = optimizer.state.get(params[i], {})
        if "exp_avg" in state and "exp_avg_sq" in state:
            tensors += [params[i], state["exp_avg"], state["exp_avg_sq"]]
            bounds += list(new)
    known.record(tensors, bounds)


def apply_guarded_step(
    known: StateBounds,
    optimizer: torch.optim.AdamW,
    params: list[torch.nn.Parameter],
    figures: StepFigures,
    *,
    grad_scale: float,
    checksum: bool = False,
) -> dict[int, int]:
    """Run the AdamW update that ``figures`` guarded, on the gradients clipped by ``grad_scale``
    (:func:`~ringtune.engine.optimizer.apply_step`, whose replica checksums it returns when ``checksum``) and
    carry the bounds of the new weights and moments into ``known`` for the next step (:func:`planned_bounds`,
    then :func:`carry_bounds`)."""
    planned = planned_bounds(optimizer, params, figures, grad_scale=grad_scale)
    sums = apply_step(optimizer, params, grad_scale=grad_scale, checksum=checksum)
    carry_bounds(known, optimizer, params, planned)
    return sums
