"""The packed, sharded batch a model forward takes: this rank's zigzag shard of one THD row.

CP is applied by what is passed in, not by forking the model code: the same modules run a whole row
(``cp_size == 1``) or one rank's zigzag shard of it, with the positions of its tokens and the CP group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.errors import ParallelConfigError
from ringtune.layout.mrope import check_shard_mrope_positions, shard_mrope_positions
from ringtune.layout.zigzag import ZigzagPlan, zigzag_plan
from ringtune.models.image_input import ImageInput
from ringtune.models.vision.placement import ShardImages, shard_images
from ringtune.ops.cp_modes import DEFAULT_ATTENTION, DEFAULT_GATED_DELTA, check_attention_mode, check_gated_delta_mode


@dataclass(frozen=True, kw_only=True)
class PackedShard:
    """This rank's part of one packed row, and how the CP layers talk.

    Attributes:
        plan: the row's :class:`ZigzagPlan` for this CP rank (``plan.local_len`` local tokens).
        positions: int64 [local_len], the position of every local token inside its own sequence
            (``plan.positions``); rotary embeddings use it. Required: a shard's tokens are not ``arange``.
        group: the CP process group (size ``plan.cp_size``); may be None only when ``cp_size == 1``.
        attention: CP attention mode of full-attention layers ("ring", "allgather", "alltoall").
        gated_delta: CP mode of GatedDeltaNet layers ("headwise", "chunkwise").
        replay_experts: routing replay (``ringtune.models.layers.moe``): one entry per decoder layer, int64
            [local_len, top_k] expert ids for a MoE layer (this rank's zigzag shard, like the tokens) or None
            (route by the router's own top-k); None: no replay anywhere.
        adapter_index: several LoRA runs in one pass (:mod:`ringtune.models.lora_mixed`): int64 [local_len],
            the index of the run whose adapters each local token uses (this rank's zigzag shard; −1 on the
            stream pad: no adapter); None: one model for every token.
        faults: debug-fault hooks the layers hand to their ops (:mod:`ringtune.debug_faults`; parity negative
            controls only): the trainer's ``--debug-fault`` for this row; :data:`NO_FAULTS` injects nothing.
        images: a row with images (vision-language models): the images this rank encodes and where their
            embeddings go (:mod:`ringtune.models.vision.placement`), and every image's span; None: text only.
        mrope_positions: int64 [3, local_len], required with ``images``: the (t, h, w) rotary positions of the
            local tokens, built on each whole sequence and zigzag-sliced
            (:func:`~ringtune.layout.mrope.shard_mrope_positions`); checked here against ``images.spans``, so
            positions numbered on the shard are refused (ParallelConfigError).
    """

    plan: ZigzagPlan
    positions: torch.Tensor
    group: dist.ProcessGroup | None = None
    attention: str = DEFAULT_ATTENTION
    gated_delta: str = DEFAULT_GATED_DELTA
    replay_experts: tuple[torch.Tensor | None, ...] | None = None
    adapter_index: torch.Tensor | None = None
    faults: FaultHooks = NO_FAULTS
    images: ShardImages | None = None
    mrope_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_attention_mode(self.attention)
        check_gated_delta_mode(self.gated_delta)
        if self.positions is None or self.positions.shape != (self.plan.local_len,):
            got = None if self.positions is None else tuple(self.positions.shape)
            raise ParallelConfigError(
                f"positions must be the rank-local positions, int64 [local_len={self.plan.local_len}]; got {got}"
            )
        want = self.plan.positions
        if not torch.equal(self.positions.to(want.device), want):
            bad = int((self.positions.to(want.device) != want).nonzero()[0, 0])
            raise ParallelConfigError(
                f"positions[{bad}]={int(self.positions[bad])} but the plan puts that local token at position "
                f"{int(want[bad])}; a shard's positions must be the plan's (plan.positions), not arange"
            )
        if self.plan.cp_size > 1:
            if self.group is None:
                raise ParallelConfigError(f"cp_size={self.plan.cp_size} needs the CP process group; got None")
            if dist.get_world_size(self.group) != self.plan.cp_size:
                raise ParallelConfigError(
                    f"CP group size {dist.get_world_size(self.group)} != plan cp_size {self.plan.cp_size}"
                )
        if (self.images is None) != (self.mrope_positions is None):
            raise ParallelConfigError("images and mrope_positions come together (a row with images needs both)")
        if self.images is not None and self.mrope_positions is not None:
            check_shard_mrope_positions(
                self.mrope_positions.cpu(), self.plan, self.images.spans, self.images.spatial_merge_size
            )

    @property
    def rotary_positions(self) -> torch.Tensor:
        """What rotary takes: ``mrope_positions`` [3, local_len] for a row with images, else ``positions``."""
        return self.positions if self.mrope_positions is None else self.mrope_positions

    @property
    def cp_size(self) -> int:
        return self.plan.cp_size

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int64: local sequence boundaries (the stream pad is the last segment)."""
        return self.plan.local_cu_seqlens


def shard_of(
    seq_lens: tuple[int, ...] | list[int],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    group: dist.ProcessGroup | None = None,
    attention: str = DEFAULT_ATTENTION,
    gated_delta: str = DEFAULT_GATED_DELTA,
    pad_multiplier: int = 1,
    pad_to: int | None = None,
    images: Sequence[Sequence[ImageInput]] | None = None,
    spatial_merge_size: int = 2,
) -> PackedShard:
    """The :class:`PackedShard` of rank ``cp_rank`` for a row of sequences ``seq_lens`` (positions from the plan).

    ``images``: per sequence, its images (``token_start`` relative to the sequence); when any sequence has one,
    the shard carries this rank's :class:`ShardImages` and the MRoPE positions built per whole sequence
    (``spatial_merge_size``: the vision tower's). None or no image at all: a text shard.
    """
    plan = zigzag_plan(seq_lens, cp_size=cp_size, cp_rank=cp_rank, pad_multiplier=pad_multiplier, pad_to=pad_to)
    shard = PackedShard(plan=plan, positions=plan.positions, group=group, attention=attention, gated_delta=gated_delta)
    if images is None or not any(images):
        return shard
    return with_images(shard, images, spatial_merge_size)


def with_images(
    shard: PackedShard,
    images: Sequence[Sequence[ImageInput]],
    spatial_merge_size: int,
    device: torch.device | str | None = None,
) -> PackedShard:
    """``shard`` carrying the row's images: this rank's :class:`ShardImages` (pixels and indices on ``device``,
    default that of ``shard.positions``) and the MRoPE positions of its tokens (built on each whole sequence,
    then zigzag-sliced; on the device of ``shard.positions``, as the text positions they replace)."""
    placed = shard_images(shard.plan, images, spatial_merge_size)
    positions = shard_mrope_positions(shard.plan, placed.spans, spatial_merge_size)
    return replace(
        shard,
        images=placed.to(shard.positions.device if device is None else device),
        mrope_positions=positions.to(shard.positions.device),
    )
