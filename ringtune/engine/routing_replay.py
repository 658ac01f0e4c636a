"""Routing replay (R3) in the trainer: a request's routing records, split into zigzag shards like its tokens.

A datum may carry ``routing`` (:class:`~ringtune.engine.batch.BatchDatum`): int64 [N, L, k], per token and per
MoE layer the k experts the sampler used (the gateway attaches it, :mod:`ringtune.gateway.routing_records`). A
packed row's records are concatenated in row order (−1 rows for a datum without records: its router chooses),
zigzag-sliced with −1 at the pads, and handed to the model as :attr:`PackedShard.replay_experts`, one
[local_len, k] slice per MoE layer; :class:`~ringtune.models.layers.moe.TopKRouter` uses those ids and
recomputes their weights from its own probabilities, so the router still learns. Under EP the replayed ids
drive the dispatch like the router's own would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ringtune.engine.batch import BatchDatum
from ringtune.layout.zigzag import ZigzagPlan, zigzag_slice
from ringtune.models.layers.moe import SparseMoE, moe_shape


def replay_shards(
    model: nn.Module, members: Sequence[BatchDatum], plan: ZigzagPlan, device: torch.device
) -> tuple[torch.Tensor | None, ...]:
    """Per decoder layer of ``model`` (a :class:`~ringtune.models.decoder.CausalLM`), this rank's shard of the
    row's records: int64 [plan.local_len, k] on ``device`` for a MoE layer, None for a dense one.

    ``members``: the row's datums in order (their routing already checked against ``moe_shape(model)``)."""
    shape = moe_shape(model)
    if shape is None:
        raise ValueError("replay_shards: the model has no MoE layer")
    layers, k, _ = shape
    full = torch.cat(
        [torch.full((0, layers, k), -1, dtype=torch.int64, device="cpu")]  # host records, sliced then moved
        + [
            d.routing if d.routing is not None else torch.full((d.num_tokens, layers, k), -1, device="cpu")
            for d in members
        ]
    )
    local = zigzag_slice(full, plan, pad_value=-1)
    moe_index = iter(range(layers))
    return tuple(
        local[:, next(moe_index)].to(device) if isinstance(layer.mlp, SparseMoE) else None
        for layer in model.model.layers  # type: ignore[union-attr]
    )
