"""Attention parity probe: every CP attention variant against the single-process reference.

For one packed row, the full-row inputs are built identically on every rank from a seed, the
reference runs in float64 on the whole row, and the CP variant runs on this rank's zigzag shard in
the chosen dtype; errors are measured on this rank's real tokens for the output, the log-sum-exp
and dq/dk/dv, and stream-pad rows must come back as output 0, lse -inf, gradient 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtune.layout import zigzag_plan, zigzag_slice
from ringtune.ops.attention import cp_attention_fn, reference_varlen_attention

FIELDS = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 16
    scale: float | None = None
    sharpness: float = 1.0
    """Multiplies q: logit standard deviation is about ``sharpness`` at the default scale."""


def make_row(seq_lens: tuple[int, ...], seed: int, shape: AttentionShape):
    """Full-row float64 ``q, k, v, dout`` and ``cu_seqlens`` of one packed row, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    q = torch.randn(T, shape.heads, shape.head_dim, generator=gen, dtype=torch.float64, device="cpu") * shape.sharpness
    k = torch.randn(T, shape.kv_heads, shape.head_dim, generator=gen, dtype=torch.float64, device="cpu")
    v = torch.randn(T, shape.kv_heads, shape.head_dim, generator=gen, dtype=torch.float64, device="cpu")
    dout = torch.randn(T, shape.heads, shape.head_dim, generator=gen, dtype=torch.float64, device="cpu")
    lens = torch.tensor(seq_lens, dtype=torch.int64, device="cpu")
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), lens.cumsum(0)])
    return q, k, v, dout, cu


def error(a: torch.Tensor, b: torch.Tensor, *, relative: bool) -> float:
    """Max |a-b|; ``relative`` divides by max(max|b|, 1) (inputs are O(1); exact zeros stay meaningful)."""
    if a.numel() == 0:
        return 0.0
    diff = float((a.double() - b.double()).abs().max())
    return diff / max(float(b.double().abs().max()), 1.0) if relative else diff


def compare_attention(
    seq_lens: tuple[int, ...],
    *,
    mode: str,
    cp_size: int,
    cp_rank: int,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    seed: int,
    shape: AttentionShape,
    pad_multiplier: int = 8,
    layout_seq_lens: tuple[int, ...] | None = None,
) -> dict[str, float | bool]:
    """Errors of ``mode`` at CP=cp_size on this rank vs the reference, for one row. Collective over ``group``.

    Returns ``{out, lse, dq, dk, dv}`` errors (absolute in float64, relative otherwise), ``finite`` and
    ``stream_pad_zero``. ``layout_seq_lens`` (negative controls only) builds the plan the CP op is
    told about from other lengths than the data were sliced with.
    """
    q, k, v, dout, cu = make_row(seq_lens, seed, shape)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))  # both sides see the same rounded inputs
    ref = [x.double().clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_varlen_attention(*ref, cu, scale=shape.scale)
    (ref_out * dout.double()).sum().backward()
    ref_grads = [torch.zeros_like(r) if r.grad is None else r.grad for r in ref]  # None: an empty row

    plan = zigzag_plan(seq_lens, cp_size=cp_size, cp_rank=cp_rank, pad_multiplier=pad_multiplier)
    told = (
        plan
        if layout_seq_lens is None
        else zigzag_plan(
            layout_seq_lens, cp_size=cp_size, cp_rank=cp_rank, pad_to=plan.local_len, pad_multiplier=pad_multiplier
        )
    )
    local = [zigzag_slice(x, plan).detach().requires_grad_() for x in (q, k, v)]
    out, lse = cp_attention_fn(mode)(*local, told, group, scale=shape.scale)
    (out * zigzag_slice(dout, plan)).sum().backward()

    real = plan.is_real
    stream_pad = torch.arange(plan.local_len, device="cpu") >= plan.real_local_len
    want = [zigzag_slice(x.detach(), plan)[real] for x in (ref_out, ref_lse, *ref_grads)]
    got = [x.detach()[real] for x in (out, lse, *(t.grad for t in local))]
    relative = dtype != torch.float64
    row: dict[str, float | bool] = {
        key: error(g, w, relative=relative) for key, g, w in zip(FIELDS, got, want, strict=True)
    }
    row["finite"] = bool(torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in local))
    row["stream_pad_zero"] = bool(
        (out[stream_pad] == 0).all()
        and (lse[stream_pad] == -math.inf).all()
        and all((t.grad[stream_pad] == 0).all() for t in local)
    )
    return row
