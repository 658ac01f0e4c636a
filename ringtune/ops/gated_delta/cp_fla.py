"""Context parallelism for GatedDeltaNet by fla's own ``fla.ops.cp`` (CUDA, the optional ``gpu`` extra).

The same data path as :mod:`~ringtune.ops.gated_delta.cp_chunkwise`, with fla doing the two exchanges:

1. Relayout zigzag -> contiguous (ringtune's all-to-all): rank r owns ``[r·L, (r+1)·L)`` of the global padded
   stream, which is fla's ``layout="contiguous"`` with ``cu_seqlens`` = the padded stream's segment bounds
   (:func:`~ringtune.layout.contiguous.global_segment_bounds`, a multiple of C tokens by construction).
2. ``fla.ops.cp.build_cp_context`` -> ``FLACPContext``; ``fla.modules.causal_conv1d.causal_conv1d(cp_context=)``
   fetches the previous rank's last K-1 raw rows (fla's conv halo, masked to the crossing sequence), and
   ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(cp_context=)`` all-gathers each rank's ``[h_local | M]``
   summary of its last segment ([Hv, Dk, Dv+Dk], float32) and merges those of the ranks the first segment
   spans (an affine chain, as ringtune's summaries); its backward gathers the mirrored ``dh`` summaries.
3. The output goes back to the zigzag layout by the inverse all-to-all.

fla's three all-gathers (conv tails and their gradient, the forward and backward summaries) are bound to
ringtune's :func:`~ringtune.parallel.collectives.all_gather_raw` (:func:`bind_fla_collectives`): the same bytes,
but gloo accepts them (fla asks ``all_gather_into_tensor`` for a ``[W, *shape]`` output, which gloo refuses), a
gloo group on CUDA ranks is host-staged, every all-gather passes ringtune's group-device check, and
:func:`~ringtune.parallel.measure_comm` counts them. Selected by ``--linear-cp-mode fla_cp``; float32 and bf16
inputs (the state math runs in float32), never float64 (no float64 Triton kernel: the CPU oracle stays
``chunkwise``). Where fla / Triton is missing or the tensors are not CUDA (outside Triton's interpreter) the call
raises :class:`~ringtune.ops.gated_delta.fla_kernels.FlaUnavailableError` naming the flag.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.errors import ParallelConfigError
from ringtune.layout.contiguous import global_segment_bounds, relayout_plan
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.gated_delta.core import pack_qkv, unpack_qkv
from ringtune.ops.gated_delta.fla_kernels import require_fla
from ringtune.ops.gated_delta.inputs import prepare_gated_delta_inputs
from ringtune.parallel.collectives import all_gather_raw
from ringtune.parallel.relayout import contiguous_to_zigzag, zigzag_to_contiguous

FLA_CP_FLAG = "--linear-cp-mode fla_cp"
"""How a user selects this mode (named in every refusal)."""

FLA_ALL_GATHER_USERS = ("fla.ops.cp.comm", "fla.ops.cp.chunk_delta_h", "fla.modules.causal_conv1d.cp")
"""The fla modules that call ``all_gather_into_tensor`` by a name of their own (fla 0.6.0)."""


def fla_all_gather_into_tensor(
    inp: torch.Tensor,
    out: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> tuple[torch.Tensor, None]:
    """fla's ``all_gather_into_tensor`` contract by ringtune's all-gather: ``inp`` [*s] -> ``[W, *s]`` rank order.

    ``out`` (if given) receives the result too; ``async_op`` is served synchronously (fla waits at once). Over
    ``group`` (fla passes the CP group of its context). No autograd (fla's Functions call it inside theirs).
    """
    if group is None:
        raise ValueError("fla_all_gather_into_tensor: group=None (fla.ops.cp always passes its context's group)")
    gathered = all_gather_raw(inp.reshape(1, *inp.shape), group).reshape(-1, *inp.shape)
    if out is not None:
        out.copy_(gathered.reshape(out.shape))
        return out, None
    return gathered, None


def bind_fla_collectives() -> None:
    """Point fla.ops.cp's all-gathers at :func:`fla_all_gather_into_tensor` (idempotent; imports fla)."""
    import fla.modules.causal_conv1d.cp
    import fla.ops.cp.chunk_delta_h  # noqa: F401  (imported for the rebinding below)

    for name in FLA_ALL_GATHER_USERS:
        module: Any = sys.modules[name]  # fla module: its attribute is rebound, which mypy cannot see
        module.all_gather_into_tensor = fla_all_gather_into_tensor


def fla_cp_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    plan: ZigzagPlan,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    faults: FaultHooks = NO_FAULTS,
) -> torch.Tensor:
    """GDN core of one zigzag-sharded row by contiguous parts, fla's conv halo and fla's state chain.

    Same contract as :func:`~ringtune.ops.gated_delta.cp_chunkwise.chunkwise_gated_delta` (q, k [T_local, Hk,
    Dk], v [T_local, Hv, Dv], g, beta [T_local, Hv], this rank's zigzag shard; conv_weight [channels, K],
    replicated; returns o [T_local, Hv, Dv] zigzag, in q's dtype; differentiable in every tensor; collectives over
    ``group``, the CP group of ``plan``), any head counts, float32 or bf16. Requires ``local_len >= K-1`` at CP > 1.
    ``faults`` is accepted for the shared signature; no debug fault acts here (the hand-off is fla's).
    """
    require_fla(q.device, f"GatedDeltaNet context parallelism by fla.ops.cp ({FLA_CP_FLAG})")
    if q.dtype == torch.float64:
        raise ParallelConfigError(
            f"{FLA_CP_FLAG} runs fla's float32 Triton kernels; got float64 inputs (use --linear-cp-mode chunkwise)"
        )
    size, T = plan.cp_size, k.shape[0]
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    kernel = conv_weight.shape[1]
    if size > 1 and plan.local_len < kernel - 1:
        raise ParallelConfigError(f"{FLA_CP_FLAG} needs local_len >= conv kernel - 1: {plan.local_len} < {kernel - 1}")
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    bind_fla_collectives()
    moves = relayout_plan(plan)
    packed = torch.cat([pack_qkv(q, k, v), beta], dim=1)
    mixed, bc = zigzag_to_contiguous(packed, moves, group).split([packed.shape[1] - hv, hv], dim=1)
    gc = zigzag_to_contiguous(g, moves, group)
    bounds = torch.tensor(global_segment_bounds(plan), dtype=torch.int64, device="cpu")
    context = build_cp_context(
        bounds.to(q.device), group, conv1d_kernel_size=kernel, cu_seqlens_cpu=bounds, layout="contiguous"
    )
    conv, _ = fla_conv(
        mixed.unsqueeze(0), weight=conv_weight.to(mixed.dtype), activation="silu", backend="triton", cp_context=context
    )
    qc, kc, vc = unpack_qkv(conv[0], hk, dk, hv, dv)
    qp, kp, vp, gp, bp = prepare_gated_delta_inputs(qc, kc, vc, gc, bc, scale=scale, use_qk_l2norm=True)
    o, _ = fla_rule(*(x.contiguous().unsqueeze(0) for x in (qp, kp, vp, gp, bp)), scale=1.0, cp_context=context)
    o = o[0].to(q.dtype)
    return contiguous_to_zigzag(o.reshape(T, hv * dv), moves, group).reshape(T, hv, dv)
