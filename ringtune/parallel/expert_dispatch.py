"""Expert-parallel token dispatch: each token goes once to every rank holding one of its experts, and back.

Contract of :func:`routed_experts_ep`: ``x`` [T, hidden] (this rank's tokens), ``ids`` int64 [T, k] and
``weights`` [T, k] (the router's choice) -> ``Σ_k weights[t, k] · expert_{ids[t, k]}(x[t])`` [T, hidden], with
the experts spread over the EP group of size N (rank r holds experts ``[r·E/N, (r+1)·E/N)``):

1. the (token, rank) pairs are formed: token t goes **once** to each rank that holds at least one of its
   experts, whatever the number of its experts there. One small all-to-all exchanges the counts (pairs
   and (token, expert) assignments per destination);
2. the pairs' hidden rows go to their rank (``torch.distributed.all_to_all_single`` with uneven splits),
   with each assignment's (row, local expert) as one int64 and its routing weight;
3. the expert rank runs its experts on the assignments (grouped by local expert, grouped matmuls), scales
   them by their weights and sums them per received row, so
4. one summed row per pair comes back by the reverse all-to-all and is added to its token.

Rows and weights travel through differentiable all-to-alls (:func:`ringtune.parallel.collectives.all_to_all`,
whose backward is the reverse exchange), so gradients reach ``x`` and the router's weights on the home rank
and the experts on their owner. Every rank of the EP group must call it together, once per MoE layer, in the
same order (forward and backward). Bytes sent are recorded on the active
:func:`ringtune.parallel.meter.measure_comm` meter: ``expert_dispatch`` / ``expert_combine`` (the hidden rows:
the minimum, one row per remote (token, rank) pair each way), ``expert_routes`` (int64 + weight per remote
assignment) and ``expert_counts`` (2·N int64); the backward's under the same names with ``_grad``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ringtune.parallel.collectives import all_to_all, all_to_all_raw


class LocalExperts(Protocol):
    """This rank's routed experts as the dispatch calls them (:class:`~ringtune.models.layers.moe.Experts`)."""

    num_experts: int  # E, over the whole EP group

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [n, hidden] grouped by local expert (``counts`` int64 [E/N]) -> [n, hidden]."""
        ...


def routed_experts_ep(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: LocalExperts, group: dist.ProcessGroup
) -> torch.Tensor:
    """The routed experts' output [T, hidden] over the EP ``group`` (see the module doc).

    ``experts(rows, counts)`` runs this rank's E/N experts on rows grouped by local expert (``counts``
    int64 [E/N]); ``experts.num_experts`` is the global E.
    """
    size = dist.get_world_size(group)
    tokens, k = ids.shape
    local = experts.num_experts // size
    device = x.device
    # 1. (token, destination) pairs, grouped by destination then token; each assignment's pair.
    token_of = torch.arange(tokens, device=device).repeat_interleave(k)
    flat_ids = ids.reshape(-1)
    dest = torch.div(flat_ids, local, rounding_mode="floor")
    pair_keys, pair_of = torch.unique(dest * tokens + token_of, return_inverse=True)
    pair_token = pair_keys % tokens
    send_pairs = torch.bincount(torch.div(pair_keys, tokens, rounding_mode="floor"), minlength=size)
    order = torch.argsort(dest, stable=True)  # assignments grouped by destination
    send_assign = torch.bincount(dest, minlength=size)
    first_pair = torch.cumsum(send_pairs, 0) - send_pairs
    routes = ((pair_of - first_pair[dest]) * local + flat_ids % local)[order]  # row in its block, local expert
    counts = all_to_all_raw(torch.stack([send_pairs, send_assign], 1), group, op="expert_counts")
    recv_pairs, recv_assign = counts[:, 0], counts[:, 1]
    sp, sa, rp, ra = (c.tolist() for c in (send_pairs, send_assign, recv_pairs, recv_assign))
    # 2. rows, routes and weights to the expert ranks.
    rows = all_to_all(x[pair_token], group, sp, rp, op="expert_dispatch", back_op="expert_dispatch_grad")
    routes = all_to_all_raw(routes, group, sa, ra, op="expert_routes")
    w = all_to_all(weights.reshape(-1, 1)[order], group, sa, ra, op="expert_routes", back_op="expert_routes_grad")
    # 3. every received assignment through its expert, weighted, summed per received row.
    source = torch.arange(size, device=device).repeat_interleave(recv_assign)
    row = torch.div(routes, local, rounding_mode="floor") + (torch.cumsum(recv_pairs, 0) - recv_pairs)[source]
    expert = routes % local
    by_expert = torch.argsort(expert, stable=True)
    out = experts(rows[row[by_expert]], torch.bincount(expert, minlength=local)) * w[by_expert]
    summed = rows.new_zeros(rows.shape).index_add(0, row[by_expert], out)
    # 4. one summed row per pair back home, added to its token.
    back = all_to_all(summed, group, rp, sp, op="expert_combine", back_op="expert_combine_grad")
    return x.new_zeros(x.shape).index_add(0, pair_token, back)
