"""Moving hidden states between layouts over the CP group, one all-to-all each way.

- zigzag <-> contiguous (a permutation, built on :class:`ringtune.layout.contiguous.RelayoutPlan`, pure index
  math): each token goes to exactly one rank, so a rank sends and receives ``local_len`` rows in all, never the
  full stream;
- sequence shards <-> head shards (all-to-all attention, headwise GatedDeltaNet): every rank gets the whole
  row for ``H/C`` of the heads.

Every direction is differentiable; the backward of one is the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.layout.contiguous import RelayoutPlan
from ringtune.parallel.collectives import all_to_all, all_to_all_raw


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


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[T_local, H, ...] sequence shard -> [C·T_local, H/C, ...] head shard, rows rank-major (differentiable)."""
    T, H = x.shape[:2]
    blocks = x.reshape(T, size, H // size, *x.shape[2:]).transpose(0, 1).reshape(size * T, H // size, *x.shape[2:])
    return all_to_all(blocks, group)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, size: int, *, differentiable: bool = True):
    """Inverse of :func:`sequence_to_heads`: [C·T_local, H/C, ...] -> [T_local, H, ...]."""
    moved = all_to_all(x, group) if differentiable else all_to_all_raw(x, group)
    T = x.shape[0] // size
    h = x.shape[1]
    return moved.reshape(size, T, h, *x.shape[2:]).transpose(0, 1).reshape(T, size * h, *x.shape[2:])
