"""One packed row's inputs on this CP rank: the row's columns concatenated (full layout) and zigzag-sliced
(this rank's shard), with the routing replay, the LoRA run index of each token and the row's images (the ones
this rank encodes, and the MRoPE positions built per whole sequence then sliced) riding on the shard.

Pure index work on the host plus one copy of each sliced column to the model's device; no collective (the
shard's plan is computed locally, the same on every CP rank). :class:`~ringtune.engine.trainer.Trainer` runs
the forward / backward on what :func:`microbatch_inputs` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ringtune.engine.batch import Batch
from ringtune.engine.routing_replay import replay_shards
from ringtune.layout.zigzag import zigzag_slice
from ringtune.losses import PER_TARGET_KEYS
from ringtune.models.decoder import CausalLM
from ringtune.models.logprob_head import IGNORE_INDEX
from ringtune.models.shard import PackedShard, shard_of, with_images


@dataclass(frozen=True)
class MicrobatchInputs:
    """This rank's zigzag shard of one packed row (every tensor ``[local_len, ...]`` on the model's device).

    Attributes:
        row: the request's datum indices packed in this row, in order.
        lens: their token counts (the full row is their concatenation).
        shard: the model's view of the row (plan, positions; ``replay_experts`` under routing replay,
            ``adapter_index`` for several LoRA runs in one pass, ``images`` and ``mrope_positions`` for a row
            with images).
        ids: token ids, int64.
        targets: ``[local_len]`` or ``[local_len, K]`` int64, pads IGNORE_INDEX.
        inputs: the loss's other per-token columns, float64 (pads 0).
        datum: the row-local datum index of each token, int64, pads -1.
    """

    row: tuple[int, ...]
    lens: list[int]
    shard: PackedShard
    ids: torch.Tensor
    targets: torch.Tensor
    inputs: dict[str, torch.Tensor]
    datum: torch.Tensor


def microbatch_inputs(
    batch: Batch,
    row: tuple[int, ...],
    local_len: int,
    model: CausalLM,
    *,
    cp_size: int,
    cp_rank: int,
    cp_group: dist.ProcessGroup | None,
    attention: str,
    gated_delta: str,
    pad_multiplier: int,
) -> MicrobatchInputs:
    """The inputs of packed row ``row`` (indices into ``batch.datums``) on CP rank ``cp_rank`` of ``cp_size``,
    padded to ``local_len`` tokens per rank. ``model`` gives the device (its embedding's, the head's too) and,
    under routing replay, the MoE layers' shapes.

    Every datum carries exactly ``batch.input_keys`` (a pad-only row: empty tensors of the same trailing shapes),
    so every rank runs the same loss code and the same collectives.
    """
    members = [batch.datums[i] for i in row]
    lens = [d.num_tokens for d in members]
    shard = shard_of(
        lens,
        cp_size=cp_size,
        cp_rank=cp_rank,
        group=cp_group,
        attention=attention,
        gated_delta=gated_delta,
        pad_multiplier=pad_multiplier,
        pad_to=local_len,
    )
    plan = shard.plan
    # the embedding's device, the head's too (a LoRA run's output_weight would merge a vocab x hidden tensor)
    device = model.model.embed_tokens.weight.device
    if any(d.images for d in members):  # a VL row: this rank's images and the sequences' MRoPE positions
        vision = model.config.vision
        assert vision is not None, "build_batch refuses images for a model without a vision tower"
        shard = with_images(shard, [d.images for d in members], vision.spatial_merge_size, device)
    if any(d.routing is not None for d in members):  # routing replay: zigzag-sliced like the tokens
        shard = replace(shard, replay_experts=replay_shards(model, members, plan, device))
    if batch.adapter_of_datum is not None:  # several LoRA runs in one pass: each token's run, zigzag-sliced
        runs = torch.tensor([batch.adapter_of_datum[i] for i in row], dtype=torch.int64, device="cpu")
        per_token = torch.repeat_interleave(runs, torch.tensor(lens, dtype=torch.int64, device="cpu"))
        shard = replace(shard, adapter_index=zigzag_slice(per_token, plan, pad_value=-1).to(device))
    k_shape = () if batch.target_k is None else (batch.target_k,)
    per_target = {"target_tokens", *PER_TARGET_KEYS.get(batch.loss.loss_fn, ())}

    def column(key: str, dtype: torch.dtype) -> torch.Tensor:
        empty = torch.zeros((0, *(k_shape if key in per_target else ())), dtype=dtype, device="cpu")
        return torch.cat([empty, *(d.inputs[key] for d in members)])

    ids = torch.cat([torch.zeros(0, dtype=torch.int64, device="cpu"), *(d.tokens for d in members)])
    targets = column("target_tokens", torch.int64)
    values = {k: column(k, torch.float64) for k in batch.input_keys if k != "target_tokens"}
    datum_index = torch.repeat_interleave(
        torch.arange(len(row), device="cpu"), torch.tensor(lens, dtype=torch.int64, device="cpu")
    )
    return MicrobatchInputs(
        row=row,
        lens=lens,
        shard=shard,
        ids=zigzag_slice(ids, plan).to(device),
        targets=zigzag_slice(targets, plan, pad_value=IGNORE_INDEX).to(device),
        inputs={k: zigzag_slice(v, plan).to(device) for k, v in values.items()},
        datum=zigzag_slice(datum_index, plan, pad_value=-1).to(device),
    )
