"""The Trainer's expert-parallel hooks: shard the experts over the mesh's EP group, split the gradients. With
``mesh.ep_size > 1`` (``ringtune serve --ep N``) every rank keeps 1/N of each MoE layer's experts
(:func:`ringtune.models.layers.moe.set_expert_parallel`); the non-expert gradients SUM over DP×CP and the expert
gradients over the expert replica group (:class:`ringtune.engine.gradients.GradientInvariant` checks both); the
global gradient norm adds the expert norms of the whole EP group
(:class:`ringtune.engine.grad_sync.ExpertParallelSync`). FSDP under EP: ``shard_params='dp_cp'`` only
(:mod:`ringtune.engine.expert_sharding`; ``dp`` is refused by name). HF exports and sampler snapshots
(:func:`ringtune.engine.snapshot.snapshot_of`) gather the experts first; DCP training-state checkpoints save each EP
shard as a chunk of a global tensor (:mod:`ringtune.engine.expert_checkpoint`). See docs/moe.md.
"""

from __future__ import annotations

import torch

from ringtune.errors import ParallelConfigError
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.moe import is_expert_parameter, set_expert_parallel
from ringtune.models.lora import LoraModel
from ringtune.parallel.mesh import ParallelMesh


def ep_size(mesh: ParallelMesh | None) -> int:
    """The mesh's expert-parallel size (1 without a mesh)."""
    return 1 if mesh is None else mesh.ep_size


def setup(model: CausalLM | LoraModel, mesh: ParallelMesh | None, shard_params: str) -> None:
    """Shard ``model``'s experts over ``mesh.ep_group`` when EP > 1 (a LoRA run's: those of the frozen base every
    LoRA run shares, once; its expert adapters stay whole, :mod:`ringtune.engine.lora_trainer`);
    ParallelConfigError for what EP cannot do."""
    size = ep_size(mesh)
    if size == 1:
        return
    if isinstance(model, LoraModel):
        model = model.base
    if not isinstance(model, CausalLM):
        raise ParallelConfigError(f"ep={size}: cannot shard the experts of a {type(model).__name__}")
    model.config.check_expert_parallel(size)
    if shard_params not in ("none", "dp_cp"):
        raise ParallelConfigError(
            f"shard_params={shard_params!r} with ep={size}: under expert parallelism use shard_params='dp_cp' "
            "(the experts are sharded over their expert replica group, everything else over DP x CP) or 'none'"
        )
    set_expert_parallel(model, mesh.ep_group)


def split(params: list[torch.nn.Parameter], names: dict[int, str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(non-expert gradients, expert gradients) of ``params`` (every one has a ``.grad``)."""
    dense = [p.grad for p in params if not is_expert_parameter(names[id(p)])]
    expert = [p.grad for p in params if is_expert_parameter(names[id(p)])]
    return dense, expert
