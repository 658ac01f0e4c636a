"""The optimizer step's finite guard (engine/update_guard.py): the host-side bound never passes an update that the
exact trial (optimizer.non_finite_update) refuses, the usual step passes without any trial, and the maxima read
back once are the tensors' own."""

from __future__ import annotations

import math

import pytest
import torch

from ringtune.engine.optimizer import AdamParams, new_adamw, non_finite_update, prepare_step
from ringtune.engine.update_guard import StepFigures, read_step_figures, unsafe_updates, update_is_bounded

FLOAT32_MAX = torch.finfo(torch.float32).max


def _stepped(kernel: str, grads: list[torch.Tensor], adam: AdamParams, steps: int = 1):
    """Parameters of ones with AdamW state after ``steps`` steps of small gradients, then ``grads`` set."""
    params = [torch.nn.Parameter(torch.ones_like(g)) for g in grads]
    optimizer = new_adamw(params, kernel)
    prepare_step(optimizer, AdamParams(learning_rate=1e-3), norm=1.0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    prepare_step(optimizer, adam, norm=1.0)
    return params, optimizer


def _figures(params, optimizer) -> StepFigures:
    return read_step_figures(params, optimizer, torch.zeros((), dtype=torch.float64))


@pytest.mark.parametrize("kernel", ["torch_default", "fused"])
def test_bound_never_passes_what_the_trial_refuses(kernel: str) -> None:
    """Gradients, learning rates and eps from tame to overflowing (float32): wherever the trial finds a non-finite
    weight or moment, the bound failed too; the tame cases pass the bound (no trial needed)."""
    gen = torch.Generator().manual_seed(0)
    checked = refused = passed = 0
    for magnitude in (1e-3, 1.0, 1e10, 1e18, 1e19, 1e20, 2.9e32, 1e38):
        for lr in (1e-4, 1.0, 1e30, 1e39):
            for eps in (1e-12, 1e-8, 1e-45):
                grads = [torch.randn(7, 3, generator=gen) * magnitude, torch.randn(5, generator=gen)]
                adam = AdamParams(learning_rate=lr, eps=eps, weight_decay=0.01)
                params, optimizer = _stepped(kernel, grads, adam)
                figures = _figures(params, optimizer)
                trial = set(non_finite_update(optimizer, params))
                for i, p in enumerate(params):
                    group = optimizer.param_groups[0]
                    bounded = update_is_bounded(
                        weight=figures.weights[i], grad=figures.grads[i], exp_avg=figures.exp_avg[i],
                        exp_avg_sq=figures.exp_avg_sq[i], group=group, dtype=p.dtype,
                    )  # fmt: skip
                    checked += 1
                    refused += i in trial
                    passed += bounded
                    assert not (bounded and i in trial), (magnitude, lr, eps, i)
                    if magnitude <= 1.0 and lr <= 1.0 and eps >= 1e-12:
                        assert bounded, (magnitude, lr, eps, i)
                assert unsafe_updates(optimizer, params, figures, grad_scale=1.0) == sorted(trial)
    assert refused > 0 and passed > 0 and checked == 8 * 4 * 3 * 2


def test_figures_are_the_tensors_maxima_read_once() -> None:
    """Max |weight|, |gradient|, |moment| per parameter (0 where a moment is missing; NaN / inf where held)."""
    params = [torch.nn.Parameter(torch.tensor([1.0, -3.0])), torch.nn.Parameter(torch.tensor([2.0, float("nan")]))]
    params[0].grad = torch.tensor([-5.0, 0.5])
    params[1].grad = torch.tensor([float("inf"), 1.0])
    optimizer = new_adamw(params, "torch_default")
    figures = read_step_figures(params, optimizer, torch.tensor(4.0, dtype=torch.float64))
    assert figures.norm == 4.0 and figures.weights[0] == 3.0 and math.isnan(figures.weights[1])
    assert figures.grads == [5.0, math.inf] and figures.exp_avg == [0.0, 0.0] and figures.exp_avg_sq == [0.0, 0.0]
    assert figures.non_finite_weights() == [1]


def test_eps_below_the_dtypes_normals_and_huge_weights_are_not_bounded() -> None:
    group = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "betas": (0.9, 0.95)}
    args = {"grad": 1.0, "exp_avg": 1.0, "exp_avg_sq": 1.0, "dtype": torch.float32}
    assert update_is_bounded(weight=1.0, group=group, **args)
    assert not update_is_bounded(weight=1.0, group={**group, "eps": 1e-40}, **args)
    assert not update_is_bounded(weight=0.5 * FLOAT32_MAX, group=group, **args)
    assert not update_is_bounded(weight=math.nan, group=group, **args)
    assert update_is_bounded(weight=1e300, group=group, **{**args, "dtype": torch.float64})
