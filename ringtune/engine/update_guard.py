"""The optimizer step's finite guard without copying the model: which parameters hold non-finite weights, and
which AdamW updates could make a weight or moment non-finite, from a few fused reductions read back once.

:func:`read_step_figures` stacks the gradient norm and, per parameter, max |weight|, max |gradient|, max |first
moment| and max |second moment| (this rank's local shards; ``torch._foreach_norm`` with ``ord=inf``, which
propagates NaN and inf) into one float64 vector and reads it with one host sync.

:func:`unsafe_updates` then bounds every element of AdamW's update from those maxima on the host, in float64,
following torch's AdamW arithmetic (decoupled weight decay ``p·(1 − lr·wd)``; ``m ← lerp(m, g, 1 − β1)``;
``v ← β2·v + (1 − β2)·g·g``; ``p ← p − lr/(1 − β1^t) · m / (√v/√(1 − β2^t) + eps)``), with the bias corrections
at their worst (t = 1) so no step count is read. Every intermediate and result is bounded by :data:`HEADROOM`
times the dtype's largest finite value; a parameter whose bound holds cannot overflow (its trial would pass).
Only the parameters whose bound fails (a huge gradient, learning rate or moment; eps below the dtype's
smallest normal) get the exact trial of :func:`ringtune.engine.optimizer.non_finite_update` on copies, so the
refusals are the trial's, and the usual step copies nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ringtune.engine.optimizer import non_finite_update
from ringtune.engine.tensor_norms import local, max_abs

HEADROOM = 0.25
"""Fraction of the dtype's largest finite value every bounded quantity must stay under (covers the rounding of
each operation, and kernels that order the operations differently: fused, foreach, per tensor)."""


@dataclass(frozen=True)
class StepFigures:
    """What the guard reads back, once: the global gradient norm and this rank's per-parameter maxima (float64
    host numbers, in ``params`` order; a missing moment counts 0)."""

    norm: float
    weights: list[float]
    grads: list[float]
    exp_avg: list[float]
    exp_avg_sq: list[float]

    def non_finite_weights(self) -> list[int]:
        """Indices of the parameters holding a NaN or an inf."""
        return [i for i, w in enumerate(self.weights) if not math.isfinite(w)]


def _moments(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], key: str) -> list[torch.Tensor]:
    """Each parameter's moment ``key`` (local shard), or an empty tensor where AdamW has none yet."""
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.append(local(state[key]) if key in state else torch.zeros(0, device=local(p.detach()).device))
    return out


def read_step_figures(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    norm: torch.Tensor,
    grad_maxima: torch.Tensor | None = None,
) -> StepFigures:
    """One host sync for the step's guard: ``norm`` (a float64 0-d device tensor, from the gradient sync) and the
    maxima of every local weight, gradient (None counts 0) and AdamW moment, fused per list. ``grad_maxima``: the
    gradients' maxima already taken (float64 ``[len(params)]`` on ``norm``'s device, e.g. by
    :meth:`~ringtune.engine.grad_sync.GradientSync.norm_and_grad_maxima` in the norm's pass); None: taken here."""
    device = norm.device
    n = len(params)
    if grad_maxima is None:
        grads = [local(p.grad) if p.grad is not None else torch.zeros(0, device=device) for p in params]
        grad_maxima = max_abs(grads, device)
    parts = [
        norm.reshape(1).to(torch.float64),
        max_abs([local(p.detach()) for p in params], device),
        grad_maxima.to(device, torch.float64),
        max_abs(_moments(optimizer, params, "exp_avg"), device),
        max_abs(_moments(optimizer, params, "exp_avg_sq"), device),
    ]
    values = torch.cat(parts).tolist()
    return StepFigures(values[0], values[1 : 1 + n], values[1 + n : 1 + 2 * n], values[1 + 2 * n : 1 + 3 * n],
                       values[1 + 3 * n :])  # fmt: skip


def update_is_bounded(
    *, weight: float, grad: float, exp_avg: float, exp_avg_sq: float, group: dict, dtype: torch.dtype
) -> bool:
    """Whether AdamW with ``group``'s settings certainly keeps every element of a ``dtype`` parameter and its
    moments finite, given max |weight|, max |gradient| (after clipping) and max |moment| (float64 host numbers).
    False also for NaN / inf inputs (every comparison with NaN is False)."""
    limit = HEADROOM * torch.finfo(dtype).max
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    if eps < torch.finfo(dtype).tiny:  # eps rounds to a subnormal or 0 in the dtype: no bound on m / denom
        return False
    decay = abs(1.0 - lr * wd)
    m_max = max(exp_avg, grad)  # the new m is a convex combination of m and g; g − m is within m_max + grad
    v_max = exp_avg_sq + grad * grad  # β2·v + (1 − β2)·g·g, the product g·g formed first
    step_size = lr / (1.0 - beta1) if beta1 < 1 else math.inf  # lr / (1 − β1^t), largest at t = 1
    denom = math.sqrt(v_max) / math.sqrt(1.0 - beta2) + eps  # √v / √(1 − β2^t) + eps, largest at t = 1
    ratio = m_max / eps  # m / denom, denom >= eps
    bounded = [decay, weight * decay, exp_avg + grad, grad * grad, v_max, denom, step_size, step_size * m_max, ratio]
    bounded.append(weight * decay + step_size * ratio)
    return all(x <= limit for x in bounded)


def unsafe_updates(
    optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], figures: StepFigures, *, grad_scale: float
) -> list[int]:
    """Indices into ``params`` whose AdamW update would put a non-finite value in the weight or a moment (run after
    :func:`~ringtune.engine.optimizer.prepare_step`, which clipped the gradients by ``grad_scale``; changes
    nothing). Bounded parameters pass on the host; the rest get the exact trial on copies (its extra memory:
    three copies of the largest such parameter, and one more host sync)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    doubtful = []
    for i, p in enumerate(params):
        if p.grad is None or id(p) not in group_of:
            continue
        bounded = update_is_bounded(
            weight=figures.weights[i],
            grad=figures.grads[i] * grad_scale,
            exp_avg=figures.exp_avg[i],
            exp_avg_sq=figures.exp_avg_sq[i],
            group=group_of[id(p)],
            dtype=p.dtype,
        )
        if not bounded:
            doubtful.append(i)
    if not doubtful:
        return []
    return non_finite_update(optimizer, params, only=set(doubtful))
