"""The trainer of a LoRA run: :class:`~ringtune.engine.trainer.Trainer` on a :class:`~ringtune.models.lora.LoraModel`.

Everything the engine does for full weights it does for the adapters, unchanged: the trainer's parameters are
the model's ``requires_grad`` ones, i.e. the adapters (the base is frozen and not a submodule), so
forward_backward accumulates adapter gradients, optim_step SUMs them over DP×CP (invariant-checked), clips
and runs AdamW on them, and the DCP checkpoint of save_state / load_state holds adapters + their moments +
step (a few MiB), plus the run's :class:`~ringtune.models.lora.LoraSpec` in ``extra["lora"]``. A checkpoint of
another spec (shapes or targets) or of a full fine-tuning run is refused by the load plan (UserInputError).

What differs: the HF export for sampling writes the merged weights (:mod:`ringtune.models.lora_merge`), and
:meth:`LoraTrainer.sampler_snapshot` gives the sampler a copy of the adapters on the shared base. FSDP
sharding is refused: the adapters are small, and the base is frozen and shared, not a run's state.

Under expert parallelism the shared base's experts are sharded over the EP group (once, by the first LoRA run)
while every run's adapters stay whole: an expert adapter's per-expert half is [E, ...] on every rank, and a
rank's forward uses (and its backward fills) the rows of its own experts only, so the plain SUM of the adapter
gradients over DP×CP is each expert's sum over its replicas, exactly as without EP. The sampler and the merged
export run on :func:`whole_base`, a copy of the base with every expert.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringtune.engine import sharding
from ringtune.engine.checkpoint import export_hf_weights
from ringtune.engine.snapshot import snapshot_of
from ringtune.engine.trainer import Trainer
from ringtune.errors import ParallelConfigError
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.moe import moe_blocks
from ringtune.models.lora import LoraModel
from ringtune.models.lora_merge import merged_config, merged_state
from ringtune.models.lora_peft import write_peft_adapter
from ringtune.models.lora_snapshot import LoraSnapshot
from ringtune.parallel.control import run_on_source
from ringtune.parallel.mesh import ParallelMesh


class LoraTrainer(Trainer):
    """A :class:`Trainer` whose model is a :class:`LoraModel` (same arguments; ``shard_params`` must be none).

    Raises ParallelConfigError for ``shard_params`` other than ``"none"``/False.
    """

    def __init__(self, model: LoraModel, mesh: ParallelMesh | None, **options: Any) -> None:
        if sharding.check_sharding(options.get("shard_params", False)) != "none":
            raise ParallelConfigError(
                f"shard_params={options['shard_params']!r}: a LoRA run's adapters are not sharded (they are small; "
                "the frozen base is shared by every LoRA run); serve with --shard-params none for LoRA"
            )
        options.pop("shard_params", None)
        super().__init__(model, mesh, **options)  # type: ignore[arg-type]
        self.lora: LoraModel = model

    def save_state(self, path: str, *, extra: dict | None = None) -> None:
        """Adapters + their AdamW moments + step, with the spec in ``extra["lora"]``; see :meth:`Trainer.save_state`."""
        super().save_state(path, extra={**(extra or {}), "lora": self.lora.spec.to_dict()})

    def export_hf(self, path: str) -> None:
        """The merged weights as an HF checkpoint directory (untied when the unembedding is adapted on tied
        embeddings), in ``export_dtype`` when mixed, plus the adapters in the PEFT format
        (:mod:`ringtune.models.lora_peft`: ``adapter_model.safetensors`` + ``adapter_config.json``) in the same
        directory; written by the control group's rank 0. The HF part is written atomically, the two adapter
        files right after it (the gateway records the export only once both are in place)."""
        self._check_usable()
        with torch.device("meta"):
            shell = CausalLM(merged_config(self.lora))  # only its config is read by the writer
        base = whole_base(self.lora.base)  # EP: every expert (collective, the copy is made once)
        state = merged_state(self.lora, base) if self.is_result_rank else None
        export_hf_weights(shell, path, group=self.control_group, dtype=self.export_dtype, state=state)
        run_on_source(lambda: write_peft_adapter(self.lora, path), self.control_group)

    def sampler_snapshot(self) -> LoraSnapshot:
        """The sampler's copy of this run now: its adapters on the shared base (models/lora_snapshot.py); under
        expert parallelism on :func:`whole_base` (the sampler decodes a request on one rank)."""
        self._check_usable()
        return LoraSnapshot(self.lora, whole_base(self.lora.base))


def whole_base(base: CausalLM) -> CausalLM:
    """``base`` itself, or, when its experts are sharded over an EP group, a frozen copy with every expert, made
    once and kept on ``base`` (the base is frozen, so the copy stays right; one more model per rank, shared by
    every LoRA run's sampler and export). Collective over the EP group the first time (every rank calls it)."""
    if not any(b.ep_group is not None and dist.get_world_size(b.ep_group) > 1 for b in moe_blocks(base)):
        return base
    whole = getattr(base, "_whole_copy", None)
    if whole is None:
        whole = snapshot_of(base)  # the sampler's whole inference copy (experts gathered over EP)
        object.__setattr__(base, "_whole_copy", whole)
    return whole
