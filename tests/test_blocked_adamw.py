"""Where the optimizer step clips: on the CPU in cache-sized blocks (engine/blocked_adamw.py), where clipping, torch's
AdamW and the replica checksums block by block give the bits of clipping every gradient, ``optimizer.step()`` and
``checksums`` in turn, for every dtype, setting and tensor size (blocks shrunk so that small tensors span many, with
ragged ends), falling back to the plain path wherever the blocks would not be the same computation; inside torch's
fused kernel (its divisor); and in the exact trial, which clips its copy the same way."""

from __future__ import annotations

import pytest
import torch

from ringtune.engine import blocked_adamw
from ringtune.engine import optimizer as optimizer_module
from ringtune.engine.blocked_adamw import blocked_step, blocked_supported
from ringtune.engine.optimizer import AdamParams, apply_step, new_adamw, non_finite_update, prepare_step
from ringtune.engine.replica_check import checksums

SHAPES = ((37, 11), (5,), (1,), (64, 64), (3, 1, 7), (0, 3))
"""Tensor sizes around the shrunk block: one element, a ragged tail, exact multiples, a many-block tensor, none."""


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in SHAPES]


def _grads(params, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 10.0 ** (step % 3 - 1)).to(p.dtype)
            for p in params]  # fmt: skip


def _state(params, opt) -> list[torch.Tensor]:
    return [t for p in params for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam", [
    AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0),
    AdamParams(learning_rate=3e-4, beta1=0.5, beta2=0.999, eps=1e-8),
])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_give_the_bits_of_the_plain_step(monkeypatch, dtype, adam, threads) -> None:
    """Five steps of the blocked path and of clipping + ``optimizer.step()`` + ``checksums`` from the same start:
    every weight, moment and step count equal bit for bit after each, and the blocked checksums are the plain
    ones; blocks of 96 bytes (24 float32 elements), so every tensor but the smallest spans several."""
    monkeypatch.setattr(blocked_adamw, "BLOCK_BYTES", 96)
    torch.set_num_threads(threads)
    plain, blocked = _params(dtype), _params(dtype)
    opts = [new_adamw(plain, "torch_default"), new_adamw(blocked, "torch_default")]
    for step in range(5):
        grads = _grads(plain, step)
        for params in (plain, blocked):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        norm = float(torch.stack([g.double().norm() for g in grads]).norm())
        scales = [prepare_step(opt, adam, norm=norm) for opt in opts]
        assert scales[0] == scales[1]
        if step == 0:  # the moments do not exist yet: the plain path creates them
            assert not blocked_supported(opts[1], blocked)
            for params, opt in zip((plain, blocked), opts, strict=True):
                apply_step(opt, params, grad_scale=scales[0])
            continue
        assert blocked_supported(opts[1], blocked)
        for p in plain:
            p.grad.mul_(scales[0])
        opts[0].step()
        sums = blocked_step(opts[1], blocked, grad_scale=scales[0], checksum=True)
        expected, got = _state(plain, opts[0]), _state(blocked, opts[1])
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        steps = [[opt.state[p]["step"] for p in params] for params, opt in zip((plain, blocked), opts, strict=True)]
        assert all(torch.equal(a, b) for a, b in zip(*steps, strict=True))
        assert [sums[id(t)] for t in got] == checksums(expected)
        for params in (plain, blocked):
            for p in params:
                p.grad = None


@pytest.mark.parametrize("threads", [1, 2])
def test_real_blocks_of_large_tensors(threads) -> None:
    """At the real :data:`BLOCK_BYTES`: a tensor of 2.6 blocks (each block split over the threads, a ragged
    last one) and a small one, three steps with clipping and weight decay, blocked vs plain, bit for bit."""
    torch.set_num_threads(threads)
    elements = blocked_adamw.BLOCK_BYTES // 4
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(int(2.6 * elements), generator=gen), torch.randn(33, generator=gen)]
    plain, blocked = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    opts = [new_adamw(plain, "torch_default"), new_adamw(blocked, "torch_default")]
    adam = AdamParams(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=0.5)
    for step in range(3):
        grads = [torch.randn(t.shape, generator=gen) for t in start]
        for params, opt in zip((plain, blocked), opts, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            scale = prepare_step(opt, adam, norm=float(torch.cat(grads).norm()))
            if params is plain or step == 0:
                for p in params:
                    p.grad.mul_(scale)
                opt.step()
            else:
                assert blocked_supported(opt, params)
                blocked_step(opt, params, grad_scale=scale, checksum=False)
        assert all(torch.equal(a, b) for a, b in zip(_state(plain, opts[0]), _state(blocked, opts[1]), strict=True))


def test_apply_step_takes_the_blocks_where_supported(monkeypatch) -> None:
    """``apply_step`` runs the blocked path once the moments exist (checksums returned only when asked) and the
    plain path otherwise (no checksums: the replica check takes them); the gradients are dropped either way."""
    calls = []
    real = optimizer_module.blocked_step
    monkeypatch.setattr(optimizer_module, "blocked_step", lambda *a, **k: calls.append(k) or real(*a, **k))
    params = _params(torch.float32)
    opt = new_adamw(params, "torch_default")
    prepare_step(opt, AdamParams(), norm=1.0)
    for checksum, expect_blocked in ((True, False), (True, True), (False, True)):
        for p, g in zip(params, _grads(params, 0), strict=True):
            p.grad = g
        sums = apply_step(opt, params, grad_scale=1.0, checksum=checksum)
        assert bool(calls) == expect_blocked and all(p.grad is None for p in params)
        assert (len(sums) == 3 * len(params)) == (checksum and expect_blocked)
        calls.clear()


def test_unsupported_layouts_take_the_plain_path() -> None:
    """Not the single-tensor computation, or not a plain contiguous CPU tensor: the fused and foreach kernels,
    amsgrad, maximize, a non-contiguous weight or gradient, a parameter missing from the list."""

    def stepped(params, **kwargs) -> torch.optim.AdamW:
        opt = torch.optim.AdamW(params, **kwargs)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        for p in params:
            p.grad = torch.ones_like(p)
        return opt

    assert blocked_supported(stepped(_params(torch.float32)), _params(torch.float32)) is False  # other tensors
    params = _params(torch.float32)
    assert blocked_supported(stepped(params), params)
    for kwargs in ({"fused": True}, {"foreach": True}, {"amsgrad": True}, {"maximize": True}):
        params = _params(torch.float32)
        assert not blocked_supported(stepped(params, **kwargs), params), kwargs
    base = torch.randn(6, 4)
    transposed = torch.nn.Parameter(base.t())  # a non-contiguous view as a parameter
    assert not blocked_supported(stepped([transposed]), [transposed])
    params = _params(torch.float32)
    opt = stepped(params)
    params[0].grad = torch.ones(11, 37).t()  # a non-contiguous gradient
    assert not blocked_supported(opt, params)


@pytest.mark.parametrize("kernel", ["torch_default", "fused"])
def test_trial_sees_the_clipped_gradient(kernel: str) -> None:
    """``non_finite_update`` with the clip factor judges the update ``apply_step`` will run (the fused kernel's
    trial divides inside the kernel too, on a copy of the gradient): a gradient whose square overflows float32 is
    refused unclipped and passes once clipped, and the gradients are left as they were (clipping happens in
    ``apply_step`` only)."""
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = new_adamw(params, kernel)
    params[0].grad = torch.full((4,), 1e30)
    adam = AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)
    scale = prepare_step(opt, adam, norm=2e30)
    assert non_finite_update(opt, params) == [0]
    assert non_finite_update(opt, params, grad_scale=scale) == []
    assert torch.equal(params[0].grad, torch.full((4,), 1e30))


def test_fused_kernel_clips_inside() -> None:
    """With torch's fused AdamW (CPU here, as on CUDA) ``apply_step`` hands the clip factor to the kernel as its
    divisor instead of multiplying every gradient first: the same bits as the kernel run with that divisor by
    hand, within a few float32 ulps of clipping first, and the divisor is gone from the optimizer afterwards."""
    start = _params(torch.float32)
    runs = []
    for how in ("apply_step", "divisor", "clip_first"):
        params = [torch.nn.Parameter(p.detach().clone()) for p in start]
        opt = new_adamw(params, "fused")
        for step in range(3):
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = g * 100.0
            scale = prepare_step(opt, AdamParams(learning_rate=1e-2, grad_clip_norm=1.0), norm=1e4)
            assert scale < 1.0
            if how == "apply_step":
                apply_step(opt, params, grad_scale=scale)
                assert not hasattr(opt, "grad_scale")
            elif how == "divisor":
                opt.grad_scale = torch.tensor(1.0 / scale, dtype=torch.float32)
                opt.step()
                del opt.grad_scale
            else:
                for p in params:
                    p.grad.mul_(scale)
                opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(_state(params, opt))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    for a, c in zip(runs[0], runs[2], strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)  # g / (1/s) vs g * s: one rounding apart per step
