"""Per-datum outputs back to full length: zero-pad each rank's shard into its row slot, one CP all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtune.layout.zigzag import ZigzagPlan
from ringtune.parallel.collectives import all_reduce_


def gather_row(local: torch.Tensor, plan: ZigzagPlan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's per-token values -> the whole row's, identical on every rank of ``group`` (the CP group).

    Args:
        local: [local_len, ...] values of this rank's zigzag shard (pads ignored); detached, any float dtype.
        plan: this rank's plan of the row.
    Returns:
        [row_tokens, ...] in row order (unpadded). One all-reduce (SUM) over ``group``: each real token is
        held by exactly one rank, the others contribute zeros, so the sum is exact.
    """
    full = local.new_zeros((sum(plan.seq_lens), *local.shape[1:]))
    real = plan.is_real
    full[plan.row_index[real]] = local[real]
    if group is not None and plan.cp_size > 1:
        all_reduce_(full, group)
    return full
