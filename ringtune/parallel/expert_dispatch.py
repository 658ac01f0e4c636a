"""Expert-parallel token dispatch: each routed token copy goes to the rank holding its expert and comes back.

Contract of :func:`dispatch_to_experts`: ``x`` [n, hidden] holds this rank's routed token copies grouped by
global expert id (``counts`` int64 [E], the copies per expert, in expert order). Over the EP group of size N
(rank r holds experts ``[r·E/N, (r+1)·E/N)``):

1. the per-expert counts are exchanged (one all-to-all of N·E/N int64), so every rank knows how many copies
   it receives from each source for each of its experts;
2. the copies go to their expert's rank (``torch.distributed.all_to_all_single`` with uneven splits),
   arriving ordered by (source rank, local expert); they are regrouped by local expert, run through the
   grouped expert matmuls, put back in arrival order and
3. returned by the reverse all-to-all, so the result is row-aligned with ``x``.

Both all-to-alls are differentiable (the backward is the reverse exchange), so gradients flow to ``x`` on
the home rank and to the experts on their owner. Every rank of the EP group must call it together, once per
MoE layer, in the same order (forward and backward). Bytes sent are recorded (op names
``expert_dispatch`` / ``expert_combine``, and ``expert_counts`` for step 1) on the active
:func:`ringtune.parallel.meter.measure_comm` meter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ringtune.parallel.meter import record_sent


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, send: Sequence[int], recv: Sequence[int], op: str):
    """Send ``x``'s dim-0 block i (sizes ``send``) to rank i; receive blocks of sizes ``recv`` in rank order."""
    x = x.contiguous()
    rank = dist.get_rank(group)
    record_sent(op, *(b for i, b in enumerate(x.split(list(send))) if i != rank))
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, list(recv), list(send), group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send, recv, op, back_op):
        ctx.group, ctx.send, ctx.recv, ctx.back_op, ctx.op = group, send, recv, back_op, op
        return _exchange(x, group, send, recv, op)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.recv, ctx.send, ctx.back_op), None, None, None, None, None


def exchange(
    x: torch.Tensor, group: dist.ProcessGroup, send: Sequence[int], recv: Sequence[int], op: str, back_op: str
) -> torch.Tensor:
    """Differentiable uneven all-to-all on dim 0; the backward sends gradients back with the splits swapped."""
    return _Exchange.apply(x, group, tuple(send), tuple(recv), op, back_op)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts int64 [E] (copies per global expert) -> int64 [N, E/N]: row s = what source s sends to my experts."""
    size = dist.get_world_size(group)
    send = counts.reshape(size, -1)
    return _exchange(send, group, [1] * size, [1] * size, "expert_counts")


def dispatch_to_experts(
    x: torch.Tensor, counts: torch.Tensor, experts: nn.Module, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``experts(x grouped by expert)`` [n, hidden] with experts spread over ``group`` (see the module doc).

    ``experts(rows, local_counts)`` runs this rank's experts on rows grouped by local expert.
    ``group`` None or of size 1: every expert is local and no communication happens.
    """
    if group is None or dist.get_world_size(group) == 1:
        return experts(x, counts)
    size = dist.get_world_size(group)
    local = counts.numel() // size
    recv_counts = exchange_counts(counts, group)  # [N, E_local]
    send = counts.reshape(size, local).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    arrived = exchange(x, group, send, recv, "expert_dispatch", "expert_dispatch_grad")
    local_id = torch.arange(local, device=x.device).repeat(size).repeat_interleave(recv_counts.reshape(-1))
    order = torch.argsort(local_id, stable=True)  # arrival order -> grouped by local expert
    out = experts(arrived[order], recv_counts.sum(0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return exchange(out[inverse], group, recv, send, "expert_combine", "expert_combine_grad")


def gather_expert_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` (default ``model.state_dict()``) with every MoE layer's experts whole, on every EP rank.

    Collective over each expert-parallel block's ``ep_group`` (all EP ranks call it together); the expert
    shards are equal-sized, so one all-gather per tensor puts them back in expert order.
    """
    from ringtune.models.layers.moe import SparseMoE

    state = dict(model.state_dict() if state is None else state)
    for name, module in model.named_modules():
        if not isinstance(module, SparseMoE) or module.ep_group is None:
            continue
        group = module.ep_group
        for proj in ("gate_up_proj", "down_proj"):
            key = f"{name}.experts.{proj}"
            local = state[key].detach().contiguous()
            pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, local, group=group)
            state[key] = torch.cat(pieces)
    return state
