"""Moving hidden states between the zigzag and the contiguous layout: one all-to-all, a permutation.

Built on :class:`ringtune.layout.contiguous.RelayoutPlan` (pure index math). Each token goes to
exactly one rank, so a rank sends and receives ``local_len`` rows in all, never the full stream.
Both directions are differentiable; the backward of one is the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.layout.contiguous import RelayoutPlan
from ringtune.parallel.collectives import all_to_all


def _inverse(index: torch.Tensor) -> torch.Tensor:
    return torch.argsort(index)


def zigzag_to_contiguous(x: torch.Tensor, plan: RelayoutPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """[local_len, ...] zigzag shard -> [local_len, ...] contiguous part of the same rank (over ``group``)."""
    send = x.index_select(0, plan.send_index.to(x.device))
    received = all_to_all(send, group, plan.send_counts, plan.recv_counts)
    return received.index_select(0, _inverse(plan.recv_index).to(x.device))


def contiguous_to_zigzag(x: torch.Tensor, plan: RelayoutPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`zigzag_to_contiguous`: contiguous part -> zigzag shard (over ``group``)."""
    send = x.index_select(0, plan.recv_index.to(x.device))
    received = all_to_all(send, group, plan.recv_counts, plan.send_counts)
    return received.index_select(0, _inverse(plan.send_index).to(x.device))
