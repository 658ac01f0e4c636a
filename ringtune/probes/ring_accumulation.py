"""Ring attention's accumulation precision, checked on the ranks that serve: are dQ/dK/dV rounded only once?

A bfloat16 layout differs from bfloat16 CP=1 by rounding noise, and a CP path that keeps a partial sum in
bfloat16 where the float32 accumulator was meant (the ring's dK/dV hops, ``ring_dkv_exchange_bf16``) adds
noise of the same size: no model-level figure separates them (docs/parity.md, "bfloat16"). This probe gives the
ring a reference with a wider accumulation instead. On a synthetic packed row (:func:`make_row`, the CP
attention probe's inputs), each rank

1. runs the ring attention forward and backward as the server does (its device, its compute dtype, its
   default block kernel, its debug fault), getting its shard's dQ/dK/dV in the compute dtype;
2. gathers every rank's inputs and forward outputs (out, lse) over the CP group, and rebuilds its own
   dQ/dK/dV from **the same blocks** (:func:`ring_step_pairs` of every rank, the same kernel on the same
   tensors) summed in float64, then rounded once to the compute dtype;
3. counts the elements (real tokens) where 1 and 2 differ.

The ring sums bf16 block results in float32 and rounds once at the end: it differs from the float64 sum
rounded once only where float32's own error straddles a bf16 rounding boundary (measured: none of ~27K
elements). A partial rounded to bf16 on the way differs in a large fraction (measured ~0.3-0.5). The limit
:data:`MISMATCH_LIMIT` sits between. Meaningful for compute dtypes narrower than the float32 accumulator
(bfloat16, float16); for float32 / float64 the accumulator is the dtype itself and the probe reports ``None``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.debug_faults import fault_hooks
from ringtune.layout import zigzag_plan, zigzag_slice
from ringtune.ops.attention.blocks import accumulator_dtype, block_grads, default_scale, to_heads_major
from ringtune.ops.attention.kernels import select_block_kernel
from ringtune.ops.attention.ring import ring_attention
from ringtune.ops.attention.schedule import ring_step_pairs
from ringtune.probes.attention_parity import AttentionShape, make_row

SEQ_LENS = (300, 17, 1, 200, 123, 5)
"""The probe's packed row: long and 1-17-token sequences, lengths not divisible by 2·CP."""

MISMATCH_LIMIT = 0.01
"""Largest fraction of dQ/dK/dV elements allowed to differ from the float64-accumulated blocks rounded once."""

FIELDS = ("dq", "dk", "dv")

SERVED_PROBES = ("ring_accumulation",)
"""Probes a server runs on its own ranks (``POST /api/v1/ringtune/probe``,
:func:`ringtune.worker.served_probes.run_served_probe`)."""


def _gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> list[torch.Tensor]:
    """Every rank's ``x`` (equal shapes: zigzag shards are padded alike), through float32 (exact for bf16)."""
    if size == 1:
        return [x]
    wide = x.float().contiguous()
    parts = [torch.empty_like(wide) for _ in range(size)]
    dist.all_gather(parts, wide, group=group)
    return [p.to(x.dtype) for p in parts]


def ring_accumulation_counts(
    group: dist.ProcessGroup | None,
    *,
    cp_size: int,
    cp_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    fault: str | None = None,
    seed: int = 0,
    seq_lens: tuple[int, ...] = SEQ_LENS,
    shape: AttentionShape | None = None,
    pad_multiplier: int = 8,
) -> dict[str, tuple[int, int]] | None:
    """``{field: (mismatched, elements)}`` of this rank's dq/dk/dv (module docstring), or None when ``dtype``
    is its own accumulator (float32, float64). Collective over ``group`` (the CP group; None at CP = 1).

    ``fault``: the server's debug fault, handed to the ring call as the trainer hands it (:mod:`ringtune.debug_faults`).
    """
    if accumulator_dtype(dtype) == dtype:
        return None
    shape = shape or AttentionShape()
    q, k, v, dout, _ = make_row(seq_lens, seed, shape)
    q, k, v, dout = (x.to(device=device, dtype=dtype) for x in (q, k, v, dout))
    plan = zigzag_plan(seq_lens, cp_size=cp_size, cp_rank=cp_rank, pad_multiplier=pad_multiplier)
    local = [zigzag_slice(x, plan).detach().requires_grad_() for x in (q, k, v)]
    local_dout = zigzag_slice(dout, plan)
    faults = fault_hooks(fault, cp_size=cp_size, cp_rank=cp_rank, plan=plan)  # DEBUG-FAULT HOOK: as the trainer's
    out, lse = ring_attention(*local, plan, group, scale=shape.scale, faults=faults)  # type: ignore[arg-type]
    (out * local_dout).sum().backward()
    heads = [to_heads_major(x.detach()) for x in (*local, local_dout, out)]
    every = [_gather(x, group, cp_size) for x in heads]
    every_lse = _gather(lse.detach().transpose(0, 1).unsqueeze(0).contiguous(), group, cp_size)
    every_q, every_k, every_v, every_dout, every_out = every
    kernel = select_block_kernel(device, dtype, None)
    scale = default_scale(local[0], shape.scale)

    # dq of this rank's queries: its blocks against every rank's K/V, summed in float64.
    dq = torch.zeros(heads[0].shape, dtype=torch.float64, device=device)
    for src in range(cp_size):
        pairs = ring_step_pairs(plan, src)
        args = (every_dout[cp_rank], every_q[cp_rank], every_k[src], every_v[src], every_out[cp_rank])
        for _ in block_grads(*args, every_lse[cp_rank], pairs, dq, scale=scale, kernel=kernel):
            pass
    # dk/dv of this rank's keys: every rank's query blocks against them, summed in float64.
    dk = torch.zeros(heads[1].shape, dtype=torch.float64, device=device)
    dv = torch.zeros_like(dk)
    for rank in range(cp_size):
        other = zigzag_plan(seq_lens, cp_size=cp_size, cp_rank=rank, pad_multiplier=pad_multiplier)
        scratch = torch.zeros(heads[0].shape, dtype=torch.float64, device=device)
        args = (every_dout[rank], every_q[rank], every_k[cp_rank], every_v[cp_rank], every_out[rank])
        for p, bdk, bdv in block_grads(
            *args, every_lse[rank], ring_step_pairs(other, cp_rank), scratch, scale=scale, kernel=kernel
        ):
            dk[:, :, p.k_start : p.k_end] += bdk
            dv[:, :, p.k_start : p.k_end] += bdv

    real = plan.is_real.to(device)
    counts = {}
    for name, ref, x in zip(FIELDS, (dq, dk, dv), local, strict=True):
        got = to_heads_major(x.grad)[:, :, real]  # type: ignore[arg-type]
        want = ref.to(dtype)[:, :, real]
        counts[name] = (int((got != want).sum()), int(got.numel()))
    return counts


def mismatch_fraction(counts: list[dict[str, tuple[int, int]] | None]) -> dict[str, float] | None:
    """Per field, mismatched / elements over every rank's counts (None if the probe does not apply)."""
    present = [c for c in counts if c is not None]
    if not present:
        return None
    return {f: sum(c[f][0] for c in present) / max(1, sum(c[f][1] for c in present)) for f in FIELDS}
