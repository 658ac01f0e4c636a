"""SwiGLU's activation ``silu(gate) · up`` as one autograd op that keeps only its two inputs.

Autograd through ``F.silu(gate) * up`` keeps three [T, I] tensors until the backward (``gate`` for SiLU's
backward, ``silu(gate)`` and ``up`` for the product's) and runs five elementwise passes over [T, I] tensors in
the backward. :func:`silu_mul` keeps ``gate`` and ``up`` (the SiLU is recomputed in the backward, one cheap
elementwise op, as Liger's fused SwiGLU does): an MLP layer keeps 3 × I values per token instead of 4 (its
product stays saved by ``down_proj``). On the CPU it works in blocks of rows of about :data:`BLOCK_BYTES` per
operand, so each block's SiLU, products and SiLU gradient run while the block is in cache (a [8K, 768] float32
tensor is 24 MiB); on other devices the whole tensor is one block. Measured on issue 31's packed-8K step (the
``benchmarks/long_rows_cp.py`` figure C model, 2 threads, 6 interleaved rounds in one process): 0.98x the step
time of the plain expression, faster in every round; the memory is the point.

Values: the same ATen ops on the same elements as the plain expression and its autograd backward
(``silu``, ``mul``, ``silu_backward``), so the results equal :func:`reference_silu_mul`'s (tests: float64 and
float32 forward and gradients, every dtype the layers compute in).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

BLOCK_BYTES = 1 << 20
"""Bytes of one operand's block of rows on the CPU (a few such blocks stay in a core's L2 cache)."""


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up``, plain autograd: the reference of :func:`silu_mul`."""
    return F.silu(gate) * up


def _row_blocks(t: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges of the leading dimension: one on a non-CPU device, else blocks of ~``BLOCK_BYTES``; none for
    zero rows (an expert-parallel rank may receive no tokens)."""
    rows = t.shape[0] if t.dim() else 1
    if rows == 0:
        return []
    if t.device.type != "cpu" or t.dim() < 2:
        return [(0, rows)]
    row_bytes = max(1, (t.numel() // rows) * t.element_size())
    step = max(1, BLOCK_BYTES // row_bytes)
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _forward_blocks(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` into a new tensor, block by block."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    for r0, r1 in _row_blocks(out):
        torch.mul(F.silu(gate[r0:r1]), up[r0:r1], out=out[r0:r1])
    return out


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _forward_blocks(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # ctx: the forward's
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad[:2]
        d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if need_gate else None
        d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device) if need_up else None
        for r0, r1 in _row_blocks(grad):
            g, u, dy = gate[r0:r1], up[r0:r1], grad[r0:r1]
            if d_up is not None:
                torch.mul(dy, F.silu(g), out=d_up[r0:r1])
            if d_gate is not None:
                torch.ops.aten.silu_backward.grad_input(dy * u, g, grad_input=d_gate[r0:r1])
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for gate, up of one shape [rows, ...]; differentiable in both. Inputs of two dtypes
    are both cast to their promoted dtype first, as the plain expression promotes.

    Keeps only ``gate`` and ``up`` for the backward (module docstring). Per token: no communication.
    Raises ValueError when the shapes differ (the plain expression would broadcast).
    """
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul needs gate and up of one shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        dtype = torch.result_type(gate, up)
        gate, up = gate.to(dtype), up.to(dtype)
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return _forward_blocks(gate, up)  # nothing to keep (decoding, sampling)
    return _SiluMul.apply(gate, up)
