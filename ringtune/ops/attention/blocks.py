"""Running a list of attention blocks with a block kernel, merging them by log-sum-exp.

Internal layout "heads-major": q [1, Hq, T, D], k/v [1, Hkv, Tk, D] (contiguous). Accumulators are
float32 (float64 for float64 inputs). Forward: each block's (out, lse) is merged into the rows it
covers with the online-softmax rule; rows no block covers keep out 0 and lse -inf. Backward: each
block's gradients come from the kernel's backward given the MERGED output and lse, and are summed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ringtune.ops.attention.kernels import BlockKernel, select_block_kernel
from ringtune.ops.attention.merge import merge_block
from ringtune.ops.attention.packed_blocks import forward_packed, grads_packed
from ringtune.ops.attention.schedule import BlockPair


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_heads_major(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> contiguous [1, H, T, D]."""
    return x.permute(1, 0, 2).unsqueeze(0).contiguous()


def stack_heads_major(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [T, H, D] -> contiguous [2, 1, H, T, D] (= stack of both heads-major), in one copy each."""
    kv = k.new_empty((2, 1, k.shape[1], k.shape[0], k.shape[2]))
    kv[0, 0].copy_(k.permute(1, 0, 2))
    kv[1, 0].copy_(v.permute(1, 0, 2))
    return kv


def from_heads_major(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> contiguous [T, H, D]; [1, H, T] -> [T, H]."""
    x = x.squeeze(0)
    return (x.permute(1, 0, 2) if x.dim() == 3 else x.transpose(0, 1)).contiguous()


def new_accumulators(q_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero output [1, H, T, D] and -inf lse [1, H, T] in the accumulator dtype."""
    acc = accumulator_dtype(q_h.dtype)
    out = torch.zeros(q_h.shape, dtype=acc, device=q_h.device)
    lse = torch.full(q_h.shape[:-1], float("-inf"), dtype=acc, device=q_h.device)
    return out, lse


def forward_blocks(
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    pairs: list[BlockPair],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    kernel: BlockKernel,
    fresh: bool = False,
) -> None:
    """Compute every block of ``pairs`` and merge it into the accumulators ``out``/``lse`` (in place).

    ``fresh=True`` promises that no two pairs share a query row and that the rows they cover are still
    empty (out 0, lse -inf): each block is then copied in, which equals merging it into an empty row.
    A varlen kernel (``kernel.varlen``) runs once per group of blocks (:mod:`~ringtune.ops.attention.packed_blocks`).
    """
    if getattr(kernel, "varlen", False):
        forward_packed(q_h, k_h, v_h, pairs, out, lse, scale=scale, kernel=kernel, fresh=fresh)
        return
    for p in pairs:
        block_out, block_lse = kernel.forward(
            q_h[:, :, p.q_start : p.q_end],
            k_h[:, :, p.k_start : p.k_end],
            v_h[:, :, p.k_start : p.k_end],
            causal=p.causal,
            scale=scale,
        )
        rows = slice(p.q_start, p.q_end)
        if fresh:
            out[:, :, rows].copy_(block_out)
            lse[:, :, rows].copy_(block_lse)
        else:
            merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)


def backward_blocks(
    dout_h: torch.Tensor,
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    out_h: torch.Tensor,
    lse_h: torch.Tensor,
    pairs: list[BlockPair],
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale: float,
    kernel: BlockKernel,
) -> None:
    """Add every block's dq/dk/dv to the accumulators (in place); ``out_h``/``lse_h`` are the merged ones."""
    for p, bdk, bdv in block_grads(dout_h, q_h, k_h, v_h, out_h, lse_h, pairs, dq, scale=scale, kernel=kernel):
        dk[:, :, p.k_start : p.k_end] += bdk
        dv[:, :, p.k_start : p.k_end] += bdv


def block_grads(
    dout_h: torch.Tensor,
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    out_h: torch.Tensor,
    lse_h: torch.Tensor,
    pairs: list[BlockPair],
    dq: torch.Tensor,
    *,
    scale: float,
    kernel: BlockKernel,
) -> Iterator[tuple[BlockPair, torch.Tensor, torch.Tensor]]:
    """Per block of ``pairs``: add its dq to ``dq`` (in place) and yield ``(pair, dk, dv)`` of its key segment.

    The block's dk/dv come in the input dtype, [1, Hkv, k_end - k_start, D]; the caller adds them where it
    wants (an accumulator, or a buffer that arrives later), so no zeroed buffer needs to exist meanwhile.
    """
    lse_h = lse_h.to(accumulator_dtype(q_h.dtype))
    if getattr(kernel, "varlen", False):  # one backward call per group of blocks (packed_blocks.py)
        yield from grads_packed(dout_h, q_h, k_h, v_h, out_h, lse_h, pairs, dq, scale=scale, kernel=kernel)
        return
    for p in pairs:
        qs, ks = slice(p.q_start, p.q_end), slice(p.k_start, p.k_end)
        bdq, bdk, bdv = kernel.backward(
            dout_h[:, :, qs],
            q_h[:, :, qs],
            k_h[:, :, ks],
            v_h[:, :, ks],
            out_h[:, :, qs],
            lse_h[:, :, qs],
            causal=p.causal,
            scale=scale,
        )
        dq[:, :, qs] += bdq
        del bdq  # not alive during the next block's kernel
        yield p, bdk, bdv
        del bdk, bdv


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


class _VarlenBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pairs, scale, kernel):
        q_h, k_h, v_h = to_heads_major(q), to_heads_major(k), to_heads_major(v)
        out, lse = new_accumulators(q_h)
        forward_blocks(q_h, k_h, v_h, pairs, out, lse, scale=scale, kernel=kernel)
        out_h = out.to(q.dtype)
        ctx.save_for_backward(q_h, k_h, v_h, out_h, lse)
        ctx.pairs, ctx.scale, ctx.kernel = pairs, scale, kernel
        lse_t = from_heads_major(lse)
        ctx.mark_non_differentiable(lse_t)
        return from_heads_major(out_h), lse_t

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_h, k_h, v_h, out_h, lse = ctx.saved_tensors
        acc = accumulator_dtype(q_h.dtype)
        dq = torch.zeros(q_h.shape, dtype=acc, device=q_h.device)
        dk = torch.zeros(k_h.shape, dtype=acc, device=k_h.device)
        dv = torch.zeros(v_h.shape, dtype=acc, device=v_h.device)
        backward_blocks(
            to_heads_major(dout),
            q_h,
            k_h,
            v_h,
            out_h,
            lse,
            ctx.pairs,
            dq,
            dk,
            dv,
            scale=ctx.scale,
            kernel=ctx.kernel,
        )
        return (
            from_heads_major(dq).to(q_h.dtype),
            from_heads_major(dk).to(k_h.dtype),
            from_heads_major(dv).to(v_h.dtype),
            None,
            None,
            None,
        )


def varlen_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: list[BlockPair],
    *,
    scale: float | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention of ``q`` [Tq, Hq, D] over ``k``/``v`` [Tk, Hkv, D] restricted to ``pairs``.

    Returns ``(out [Tq, Hq, D], lse [Tq, Hq])``; rows no pair covers get out 0 and lse -inf.
    Single process: it talks over no group.
    """
    chosen = select_block_kernel(q.device, q.dtype, kernel)
    return _VarlenBlocks.apply(q, k, v, pairs, default_scale(q, scale), chosen)
