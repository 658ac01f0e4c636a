"""A sampler snapshot of a training run's weights: an inference copy, whole on this rank.

The engine makes it (FSDP shards and EP experts are gathered over the trainer's groups); the sampler pool
(:mod:`ringtune.sample.pool`) holds and evicts the copies, and a LoRA run's whole-base copy
(:func:`ringtune.engine.lora_trainer.whole_base`) is one too. Each copy costs one whole model in the parameters'
dtype per rank, which ``ringtune plan`` counts (``--sampler-snapshots``).
"""

from __future__ import annotations

from ringtune.engine.sharding import full_state_dict
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.moe import gather_expert_state
from ringtune.models.precision import compute_like_trainer, layers_compute_dtype, layers_exact

DEFAULT_MAX_SNAPSHOTS = 4
"""Snapshots (weight copies) a rank's sampler pool holds by default (what ``ringtune plan`` counts by default)."""


def snapshot_of(model: CausalLM) -> CausalLM:
    """An inference copy of ``model`` (same config, dtype and device; no gradients), whole on this rank, computing
    as the trainer does: a mixed-precision trainer's layers compute in its compute dtype, so do the copy's
    (:func:`~ringtune.models.precision.compute_like_trainer`).

    An FSDP-sharded model's tensors, and an expert-parallel model's experts, are gathered first (collective over
    its mesh / EP groups: every rank of it calls this together, as every rank runs ``create_sampler``)."""
    device = model.output_weight.device
    copy = CausalLM(model.config).to(dtype=model.output_weight.dtype, device=device)
    copy.load_state_dict(gather_expert_state(model, full_state_dict(model, device=device)))
    copy.requires_grad_(False)
    return compute_like_trainer(copy.eval(), layers_compute_dtype(model), exact=layers_exact(model))
