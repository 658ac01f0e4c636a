"""Varlen block kernels: one kernel call per group of blocks over all the sequences of a packed row.

A *varlen* kernel takes the query rows of many blocks packed one after another (THD: ``q`` [Nq, Hq, D]), their
key rows packed likewise (``k``/``v`` [Nk, Hkv, D]), and int32 cumulative lengths ``cu_q``/``cu_k`` [n+1]
(block i: queries ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``); every block of a call is ``causal``
(equal lengths) or every one is full. It returns ``out`` [Nq, Hq, D] and the log-sum-exp ``lse`` [Hq, Nq]
(float32), which the ring merge needs; its backward takes the *merged* output and lse of those rows (the
flash-attention backward identity) and returns ``dq`` [Nq, Hq, D], ``dk``/``dv`` [Nk, Hkv, D] (GQA folded).
:func:`ringtune.ops.attention.blocks.forward_blocks` groups a block list into such calls (``varlen_groups``).

Kernels:
- ``cuda_varlen``: torch's own flash kernel with cumulative sequence lengths (``aten._flash_attention_forward`` /
  ``_flash_attention_backward``, the ops behind ``torch.nn.attention.varlen``), float16/bfloat16 on CUDA, GQA
  native, head dim a multiple of 8 up to 256. No extra package. NOT YET RUN ON A GPU: ``benchmarks/gpu_check.py``
  compares it with the float64 CPU reference where a GPU is at hand (docs/gpu.md).
- ``cpu_varlen_loop``: the same contract on CPU by one ``cpu_flash`` call per block: the oracle of the grouping
  and packing logic in the CPU suite (and ``gpu_check.py --smoke``); not a default anywhere.

Each also serves single blocks (``forward``/``backward`` of :class:`~ringtune.ops.attention.kernels.BlockKernel`,
layout [1, H, S, D]) as a one-block call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cpu_flash(q, k, v, causal, scale):
    """One block on CPU, heads-major [1, H, S, D] (the ``cpu_flash`` kernel's op): ``(out, lse)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def cpu_flash_grad(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _block(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows ``a:b`` of a THD tensor as a contiguous heads-major block [1, H, b - a, D]."""
    return x[a:b].transpose(0, 1).unsqueeze(0).contiguous()


def _heads_major_block(fn, q, k, v, *, causal, scale):
    """Run a varlen forward ``fn`` on one block given heads-major [1, H, S, D]; return heads-major out and lse."""
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))
    cu_q = torch.tensor([0, qt.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, kt.shape[0]], dtype=torch.int32, device=q.device)
    out, lse = fn(qt, kt, vt, cu_q, cu_k, qt.shape[0], kt.shape[0], causal=causal, scale=scale)
    return out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def _heads_major_block_grad(fn, dout, q, k, v, out, lse, *, causal, scale):
    dt, qt, kt, vt, ot = (x[0].transpose(0, 1) for x in (dout, q, k, v, out))
    cu_q = torch.tensor([0, qt.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, kt.shape[0]], dtype=torch.int32, device=q.device)
    dq, dk, dv = fn(dt, qt, kt, vt, ot, lse[0], cu_q, cu_k, qt.shape[0], kt.shape[0], causal=causal, scale=scale)
    return tuple(x.transpose(0, 1).unsqueeze(0) for x in (dq, dk, dv))


@dataclass(frozen=True)
class CudaVarlenKernel:
    """torch's CUDA flash kernel over packed blocks (module docstring); float16/bfloat16 only."""

    name: str = "cuda_varlen"
    varlen: bool = True

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        # max_q >= 2: with one query row per block and GQA the kernel would take its "ngroups swapped" path,
        # which returns the lse in another layout; max_q only bounds the grid, so 2 is always valid.
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max(int(max_q), 2),
            int(max_k),
            0.0,
            causal,
            False,
            scale=scale,
            window_size_left=-1,
            window_size_right=-1,
        )
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, scale):
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # dropout is 0: never read
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse.to(torch.float32).contiguous(),
            cu_q,
            cu_k,
            max(int(max_q), 2),
            int(max_k),
            0.0,
            causal,
            rng_state,
            unused,
            scale=scale,
            window_size_left=-1,
            window_size_right=-1,
        )
        return dq, dk, dv

    def forward(self, q, k, v, *, causal, scale):
        return _heads_major_block(self.forward_varlen, q, k, v, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        return _heads_major_block_grad(self.backward_varlen, dout, q, k, v, out, lse, causal=causal, scale=scale)


@dataclass(frozen=True)
class CpuVarlenLoopKernel:
    """The varlen contract on CPU by one ``cpu_flash`` call per block (module docstring)."""

    name: str = "cpu_varlen_loop"
    varlen: bool = True

    def _spans(self, cu_q, cu_k):
        return list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:], strict=True))

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
        for qa, qb, ka, kb in self._spans(cu_q, cu_k):
            o, s = cpu_flash(_block(q, qa, qb), _block(k, ka, kb), _block(v, ka, kb), causal, scale)
            out[qa:qb] = o[0].transpose(0, 1)
            lse[:, qa:qb] = s[0]
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for qa, qb, ka, kb in self._spans(cu_q, cu_k):
            s = lse[:, qa:qb].unsqueeze(0).contiguous()
            a, b, c = cpu_flash_grad(
                _block(dout, qa, qb),
                _block(q, qa, qb),
                _block(k, ka, kb),
                _block(v, ka, kb),
                _block(out, qa, qb),
                s,
                causal,
                scale,
            )
            dq[qa:qb], dk[ka:kb], dv[ka:kb] = (x[0].transpose(0, 1) for x in (a, b, c))
        return dq, dk, dv

    def forward(self, q, k, v, *, causal, scale):
        return _heads_major_block(self.forward_varlen, q, k, v, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        return _heads_major_block_grad(self.backward_varlen, dout, q, k, v, out, lse, causal=causal, scale=scale)
