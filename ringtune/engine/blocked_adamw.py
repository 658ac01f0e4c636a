"""The optimizer step's passes over the model on the CPU, one cache-sized block at a time: the gradient clipping,
torch's own AdamW update and the replica checksums of the new weight and moments run on a block of every tensor
while it is in cache, instead of each sweeping the whole model from memory in turn.

The trainer's default kernel is torch's fused AdamW on CPU too (one pass per tensor, ~6x faster there); this module
is the update of the ``torch_default`` kernel when a trainer is given it (``Trainer(adamw_kernel=...)``).
torch's AdamW on the CPU (``foreach`` and ``fused`` off: the ``torch_default`` kernel) updates one
parameter at a time in about eight elementwise passes (weight decay, ``lerp``, ``mul`` + ``addcmul``, the
denominator's ``sqrt`` / ``div`` / ``add`` into a temporary, ``addcdiv``), each reading and writing the whole
tensor, from memory once it is larger than the cache; clipping is one more pass and the checksums three reads.
Every one of these is elementwise, or a sum that wraps (exact modulo 2^width, so order-free), so on a slice of
:data:`BLOCK_BYTES` of each tensor they give the same bits as on the whole: :func:`blocked_step` is bit-identical
to ``g.mul_(scale)`` on every gradient, ``optimizer.step()`` and
:func:`~ringtune.engine.replica_check.checksums` of every weight and moment (tests/test_blocked_adamw.py), and
costs less than ``optimizer.step()`` alone (SmolLM2-135M's real state, one thread: 0.34 s against 0.41 s;
``benchmarks/lean_step.py``, benchmarks/README.md).

The update is torch's functional ``adam`` with the param group's settings, called per block; each call is given a
copy of the parameter's step count (it adds one, as on the whole tensor, and takes the bias corrections from it),
and the count itself is advanced once after the parameter's last block. :func:`blocked_supported` says where this
is the same computation as ``optimizer.step()``: plain contiguous CPU tensors with AdamW state already created,
and groups that run the single-tensor path (not ``fused``, ``foreach``, ``capturable``, ``differentiable``,
``amsgrad``, ``maximize``); anything else (CUDA, FSDP's DTensors, the first step, which creates the moments)
runs :func:`~ringtune.engine.optimizer.apply_step`'s plain path.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as functional_adam

from ringtune.engine.replica_check import bit_sum, combined_bit_sums

BLOCK_BYTES = 1 << 20
"""Bytes of each tensor (weight, gradient, two moments, AdamW's temporary) updated at a time: the five blocks stay
inside this machine class's L3 (32 MiB here, shared by the cores), and AdamW's temporary is a block, not a whole
parameter (the embedding's would be mapped and faulted in afresh each step). On the real state of SmolLM2-135M
(float32, 1 thread) blocks of 1-2 MiB were fastest of 128 KiB-8 MiB (128 KiB: 1.6x slower, the per-call Python
overhead of ~60 us per block; 8 MiB: 1.1x)."""

_UNSUPPORTED_FLAGS = ("fused", "foreach", "capturable", "differentiable", "amsgrad", "maximize")


def _plain_cpu(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.is_contiguous()


def blocked_supported(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> bool:
    """Whether :func:`blocked_step` computes what ``optimizer.step()`` would for ``params`` (every parameter of
    ``optimizer`` with a gradient is in ``params``): an AdamW / Adam whose groups run torch's single-tensor path,
    and every parameter with a gradient a plain contiguous real CPU tensor whose gradient and moments are too,
    with its state already created (step count, ``exp_avg``, ``exp_avg_sq``)."""
    if not isinstance(optimizer, torch.optim.Adam):
        return False
    listed = {id(p) for p in params}
    for group in optimizer.param_groups:
        if any(group.get(flag) for flag in _UNSUPPORTED_FLAGS):
            return False
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            if id(p) not in listed or not {"step", "exp_avg", "exp_avg_sq"} <= state.keys():
                return False
            tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
            if p.is_complex() or not all(_plain_cpu(t) and t.shape == p.shape for t in tensors):
                return False
            if state["step"].device.type != "cpu" or p.grad.dtype != p.dtype:
                return False
    return True


def _update_block(group: dict, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step) -> None:
    """torch's functional AdamW / Adam on one block (flat views) with ``group``'s settings; ``step``: a copy of the
    parameter's count, advanced by the call."""
    beta1, beta2 = group["betas"]
    functional_adam(
        [p], [g], [m], [v], [], [step],
        foreach=False, capturable=False, fused=False, differentiable=False, amsgrad=False, maximize=False,
        decoupled_weight_decay=group.get("decoupled_weight_decay", False), beta1=beta1, beta2=beta2,
        lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
    )  # fmt: skip


@torch.no_grad()
def blocked_step(
    optimizer: torch.optim.Adam, params: list[torch.nn.Parameter], *, grad_scale: float, checksum: bool
) -> dict[int, int]:
    """Multiply every gradient by ``grad_scale`` (not at 1.0), run ``optimizer``'s update, and (``checksum``)
    return the replica checksum of every updated weight and moment keyed by ``id`` of the tensor, block by block
    (module docstring); only where :func:`blocked_supported` holds. Local: no collective, no host sync besides
    torch's own per call (the step count's ``item``). The gradients are left in place (clipped)."""
    owners: list[torch.Tensor] = []  # the tensors whose blocks' bit sums ``parts`` holds, in order
    parts: list[list[torch.Tensor]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            tensors = [p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"]]
            flat = [t.view(-1) for t in tensors]
            block = max(1, BLOCK_BYTES // p.element_size())
            kept: tuple[list[torch.Tensor], ...] = ([], [], [])
            for start in range(0, p.numel(), block):
                w, g, m, v = (t[start : start + block] for t in flat)
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                _update_block(group, w, g, m, v, state["step"].clone())
                if checksum:
                    for sums, t in zip(kept, (w, m, v), strict=True):
                        sums.append(bit_sum(t))
            state["step"] += 1
            if checksum:
                owners += [p, state["exp_avg"], state["exp_avg_sq"]]
                parts += kept
    return {id(t): s for t, s in zip(owners, combined_bit_sums(parts), strict=True)}
