"""LoRA runs on a rank: one frozen base model shared by every LoRA run, each run its adapters + moments.

The base is loaded on the first LoRA run's create (or taken from the copy rank 0 loaded to describe the model)
and kept for the server's life: a later LoRA run costs its adapters, their gradients and AdamW moments only
(:mod:`ringtune.models.lora`). The base is frozen (``requires_grad`` False) and never written: full
fine-tuning runs keep their own copies. Commands run one at a time on a rank, and each run's forward makes its
adapters the active ones on the base (:meth:`~ringtune.models.lora.LoraModel.activate`), so runs never see
each other's adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.models.decoder import CausalLM
from ringtune.models.lora import LoraModel, LoraSpec
from ringtune.parallel.mesh import ParallelMesh


class SharedBase:
    """This rank's frozen base for LoRA runs, built by ``load`` on first use (collective when ``load`` is)."""

    def __init__(self, load: Callable[[], CausalLM]) -> None:
        self._load = load
        self.model: CausalLM | None = None

    def get(self) -> CausalLM:
        """The frozen base (loaded on first use, collective: every rank asks at the same command)."""
        if self.model is None:
            self.model = self._load()
            self.model.requires_grad_(False)
        return self.model

    def forget(self, trainer: object) -> None:
        """A run is freed: if its adapters are the active ones on the base, drop them (their memory goes)."""
        lora = getattr(trainer, "lora", None)
        if self.model is not None and lora is not None and lora.slot.active is lora.adapters:
            lora.slot.active = None

    def trainer(
        self, lora: Mapping[str, Any], mesh: ParallelMesh | None, *, max_tokens_per_rank: int, **options: Any
    ) -> LoraTrainer:
        """A new LoRA run's trainer on the shared base; UserInputError for a bad spec (nothing created)."""
        spec = LoraSpec.from_dict(dict(lora))
        return LoraTrainer(LoraModel(self.get(), spec), mesh, max_tokens_per_rank=max_tokens_per_rank, **options)
