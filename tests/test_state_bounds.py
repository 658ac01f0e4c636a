"""Bounds of the weights and AdamW moments carried between optimizer steps (engine/state_bounds.py,
engine/update_guard.py carry_bounds): over real AdamW steps they stay above the tensors' exact maxima and no
weight or moment is read; an in-place write, a replaced tensor or a loose bound sends the guard back to the exact
figures, and the verdicts stay the exact trial's."""

from __future__ import annotations

import math

import pytest
import torch

from ringtune.engine import update_guard
from ringtune.engine.optimizer import AdamParams, apply_step, new_adamw, non_finite_update, prepare_step
from ringtune.engine.state_bounds import StateBounds
from ringtune.engine.tensor_norms import max_abs
from ringtune.engine.update_guard import carry_bounds, planned_bounds, read_step_figures, unsafe_updates


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in ((6, 5), (7,), (3, 3))]


def _step(params, optimizer, known: StateBounds, adam: AdamParams, grads: list[torch.Tensor]):
    """One guarded step as Trainer.optim_step runs it (the gradients' exact maxima as their bounds)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.stack([g.double().norm() for g in grads]).norm()
    figures = read_step_figures(params, optimizer, norm, known=known)
    scale = prepare_step(optimizer, adam, norm=figures.norm)
    unsafe = unsafe_updates(optimizer, params, figures, grad_scale=scale)
    planned = planned_bounds(optimizer, params, figures, grad_scale=scale)
    apply_step(optimizer, params, grad_scale=scale)
    carry_bounds(known, optimizer, params, planned)
    return figures, unsafe


def _exact(params, optimizer) -> list[list[float]]:
    kinds = [params, *([optimizer.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq"))]
    return [max_abs([t.detach() for t in tensors]).tolist() for tensors in kinds]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["torch_default", "fused"])
def test_carried_bounds_stay_above_the_maxima_and_read_nothing(monkeypatch, dtype, kernel) -> None:
    params = _params(dtype)
    optimizer = new_adamw(params, kernel)
    known = StateBounds()
    reads = []
    real_max_abs = update_guard.max_abs
    monkeypatch.setattr(update_guard, "max_abs", lambda ts, d="cpu": reads.append(len(ts)) or real_max_abs(ts, d))
    gen = torch.Generator().manual_seed(1)
    adams = [AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0), AdamParams(learning_rate=0.5)]
    for step in range(12):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) * 10 ** (step % 4 - 2) for p in params]
        reads.clear()
        figures, unsafe = _step(params, optimizer, known, adams[step % 2], grads)
        assert unsafe == []
        if step > 0:  # every weight and moment figure was carried: nothing read but the gradients' maxima
            assert all(figures.carried) and reads == [len(params), 0, 0, 0], (step, reads)
            assert figures.non_finite_weights() == []
        exact = _exact(params, optimizer)
        bounds = [[known.lookup(t) for t in tensors] for tensors in
                  (params, *([optimizer.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq")))]  # fmt: skip
        for kind_exact, kind_bounds in zip(exact, bounds, strict=True):
            for e, b in zip(kind_exact, kind_bounds, strict=True):
                assert b is not None and b >= e, (step, e, b)


def test_a_write_a_new_tensor_or_a_load_sends_the_guard_back_to_the_tensors() -> None:
    params = _params(torch.float32)
    optimizer = new_adamw(params, "torch_default")
    known = StateBounds()
    adam = AdamParams(learning_rate=1e-3)
    _step(params, optimizer, known, adam, [torch.ones_like(p) for p in params])
    with torch.no_grad():
        params[1][2] = math.nan  # in place: the version counter moves
    optimizer.state[params[2]]["exp_avg"] = optimizer.state[params[2]]["exp_avg"].clone()  # another tensor
    for p in params:
        p.grad = torch.ones_like(p)
    figures = read_step_figures(params, optimizer, torch.tensor(1.0, dtype=torch.float64), known=known)
    assert figures.non_finite_weights() == [1] and math.isnan(figures.weights[1])  # read: the write shows
    assert figures.exp_avg[2] == float(optimizer.state[params[2]]["exp_avg"].abs().max())
    known.forget()
    assert not any(read_step_figures(params, optimizer, torch.tensor(1.0), known=known).carried)


def test_a_loose_bound_is_read_exactly_and_the_verdicts_stay_the_trials() -> None:
    """A carried bound too large to prove the update safe is replaced by the exact maxima (no trial for a tame
    update); an update that really overflows is refused by the trial either way."""
    params = _params(torch.float32)
    optimizer = new_adamw(params, "torch_default")
    known = StateBounds()
    _step(params, optimizer, known, AdamParams(learning_rate=1e-3), [torch.ones_like(p) for p in params])
    known.record([params[0]], [1e38])  # a bound that proves nothing (as after very many steps)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    figures = read_step_figures(params, optimizer, torch.tensor(1.0, dtype=torch.float64), known=known)
    assert figures.carried[0] and figures.weights[0] == 1e38
    prepare_step(optimizer, AdamParams(learning_rate=1e-3), norm=1.0)
    assert unsafe_updates(optimizer, params, figures, grad_scale=1.0) == []
    assert not figures.carried[0] and figures.weights[0] == float(params[0].detach().abs().max())
    params[2].grad = torch.full_like(params[2], 2.9e32)  # its square overflows float32's second moment
    known.record([params[2]], [1e38])
    figures = read_step_figures(params, optimizer, torch.tensor(1.0, dtype=torch.float64), known=known)
    assert unsafe_updates(optimizer, params, figures, grad_scale=1.0) == [2] == non_finite_update(optimizer, params)
