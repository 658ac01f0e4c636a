"""Local block kernels of attention, and the one place that picks one.

A block kernel computes exact attention of a query segment against a key segment of the same
sequence, either ``full`` (every query sees every key) or ``causal`` (equal lengths, query i sees
keys 0..i), and returns the log-sum-exp so that blocks can be merged; its backward takes the
*merged* output and log-sum-exp of all blocks (the flash-attention backward identity).

Shapes: q [1, Hq, Sq, D], k/v [1, Hkv, Sk, D] (GQA native), out [1, Hq, Sq, D], lse [1, Hq, Sq]
(float64 for float64 inputs, float32 otherwise).

Kernels:
- ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (tiled, O(S) memory, returns LSE).
- ``math``: plain torch on any device, materialises [Sq × Sk] per block; the portable fallback.
- ``cuda_flash``: ``aten._scaled_dot_product_flash_attention`` on CUDA, one call per block (GQA expanded).
- ``cuda_varlen`` (``flash_cuda.py``): torch's varlen flash kernel, one call per group of blocks over all the
  sequences of a row (``varlen = True``: :func:`~ringtune.ops.attention.blocks.forward_blocks` packs them); the
  CUDA default for float16/bfloat16.
- ``cpu_varlen_loop`` (``flash_cuda.py``): the varlen contract on CPU, one ``cpu_flash`` call per block; the
  CPU oracle of the packing, never a default.

The CUDA kernels are not exercised by the CPU test suite and have NOT YET RUN ON A GPU; ``benchmarks/gpu_check.py``
compares them with the float64 CPU reference (docs/gpu.md). Selecting one for a CPU tensor, or for a dtype it does
not take, is a ValueError naming the kernel, the device/dtype and what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ringtune.ops.attention.flash_cuda import CpuVarlenLoopKernel, CudaVarlenKernel, cpu_flash, cpu_flash_grad


class BlockKernel(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the kernels are frozen dataclasses

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class CpuFlashKernel:
    name: str = "cpu_flash"

    def forward(self, q, k, v, *, causal, scale):
        return cpu_flash(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        return cpu_flash_grad(dout, q, k, v, out, lse, causal, scale)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class MathKernel:
    """Plain torch: exact, any device, [Sq × Sk] memory per block."""

    name: str = "math"

    def _probs(self, q, k, lse, causal, scale):
        acc = _lse_dtype(q.dtype)
        group = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(group, dim=1).to(acc)
        scores = (q.to(acc) @ kk.transpose(-1, -2)) * scale
        if causal:
            n = q.shape[2]
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q, k, v, *, causal, scale):
        probs, lse = self._probs(q, k, None, causal, scale)
        group = q.shape[1] // k.shape[1]
        out = probs @ v.repeat_interleave(group, dim=1).to(probs.dtype)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        acc = _lse_dtype(q.dtype)
        group = q.shape[1] // k.shape[1]
        probs, _ = self._probs(q, k, lse.to(acc), causal, scale)
        vv = v.repeat_interleave(group, dim=1).to(acc)
        kk = k.repeat_interleave(group, dim=1).to(acc)
        do = dout.to(acc)
        dv = probs.transpose(-1, -2) @ do
        dp = do @ vv.transpose(-1, -2)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = probs * (dp - delta) * scale
        dq = ds @ kk
        dk = ds.transpose(-1, -2) @ q.to(acc)

        def fold(x):  # sum the query heads of each kv head
            b, h, s, d = x.shape
            return x.view(b, h // group, group, s, d).sum(2)

        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


@dataclass(frozen=True)
class CudaFlashKernel:
    """torch's CUDA flash kernel; not exercised by the CPU test suite."""

    name: str = "cuda_flash"

    def forward(self, q, k, v, *, causal, scale):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        return out, lse[..., : q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            ke,
            ve,
            out,
            lse.contiguous(),
            zero,
            zero,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            zero,
            zero,
            scale=scale,
        )
        b, h, s, d = dk.shape
        return dq, dk.view(b, h // group, group, s, d).sum(2), dv.view(b, h // group, group, s, d).sum(2)


KERNELS: dict[str, BlockKernel] = {
    k.name: k for k in (CpuFlashKernel(), MathKernel(), CudaFlashKernel(), CudaVarlenKernel(), CpuVarlenLoopKernel())
}

NEEDS: dict[str, tuple[str, tuple[torch.dtype, ...]]] = {
    "cpu_flash": ("cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16)),
    "cpu_varlen_loop": ("cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16)),
    "cuda_flash": ("cuda", (torch.float16, torch.bfloat16)),
    "cuda_varlen": ("cuda", (torch.float16, torch.bfloat16)),
}
"""The device type and dtypes each device-bound kernel takes (``math`` takes any)."""


def select_block_kernel(device: torch.device, dtype: torch.dtype, name: str | None = None) -> BlockKernel:
    """The block kernel for ``device``/``dtype``: the one place the choice is made.

    ``name`` forces a kernel from :data:`KERNELS` (ValueError if it cannot take ``device``/``dtype``, see
    :data:`NEEDS`). Default: ``cpu_flash`` on CPU; on CUDA ``cuda_varlen`` for float16/bfloat16 and ``math``
    otherwise (the flash kernels have no fp32/fp64).
    """
    if name is not None:
        if name not in KERNELS:
            raise ValueError(f"unknown attention block kernel {name!r}; choose one of {sorted(KERNELS)}")
        if name in NEEDS:
            kind, dtypes = NEEDS[name]
            if device.type != kind or dtype not in dtypes:
                raise ValueError(
                    f"attention block kernel {name!r} takes {kind} tensors of {[str(d) for d in dtypes]}; "
                    f"got {device.type} {dtype}"
                )
        return KERNELS[name]
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return KERNELS["cuda_varlen"]
    return KERNELS["math"]
