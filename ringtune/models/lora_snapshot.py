"""A LoRA run's sampler weights on the shared frozen base: a frozen copy of its adapters, not a merged model.

``save_weights_for_sampler`` / ``save_weights_and_get_sampling_client`` of a LoRA run give the sampler a
:class:`LoraSnapshot`: the base every LoRA run of the rank shares plus a copy of the run's adapters as they
are now (the run's later steps do not change it). It quacks like a :class:`~ringtune.models.decoder.CausalLM`
for the sampler (``config``, ``model``, ``output_weight``, ``hidden_states``, ``decode_hidden``); each forward
makes its adapters the active ones on the base's :class:`~ringtune.models.lora.LoraSlot`, exactly as the
training forward does, so the sampler computes what the trainer computes, in the same precision. A snapshot
costs the adapters (a few MiB to a few hundred), not a copy of the model; the unembedding's adapter is
merged into a ``[vocab, hidden]`` weight only while a generation or prefill reads it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ringtune.models.decoder import CausalLM
from ringtune.models.lora import AdaptersOnBase, LoraModel, lora_slot
from ringtune.models.shard import PackedShard


class LoraSnapshot(AdaptersOnBase, nn.Module):
    """A sampling copy of ``lora``'s adapters on its base (``base`` is a submodule: MoE routing capture and
    device queries see its layers; the snapshot's own tensors are the adapters' copies, no gradient)."""

    def __init__(self, lora: LoraModel, base: CausalLM | None = None) -> None:
        """``base``: the model the adapters run on (default the run's own base; under expert parallelism a copy
        of it with every expert, since the sampler decodes on one rank)."""
        super().__init__()
        self.base = lora.base if base is None else base
        self.config = self.base.config
        object.__setattr__(self, "slot", lora_slot(self.base))
        self.adapters = copy.deepcopy(lora.adapters).requires_grad_(False)
        self.hook_adapters()

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the base's output weight, plus ``scale · B @ A`` when the unembedding is adapted."""
        with torch.no_grad():
            return self.adapters.output_weight(self.base.output_weight)

    def adapter_bytes(self) -> int:
        """Bytes of this snapshot's own tensors (the adapters' copies)."""
        return sum(t.numel() * t.element_size() for t in self.adapters.parameters())

    def hidden_states(self, input_ids: torch.Tensor, shard: PackedShard, **kwargs) -> torch.Tensor:
        """:meth:`CausalLM.hidden_states` with this snapshot's adapters (collective over the shard's CP group)."""
        self.activate()
        return self.base.hidden_states(input_ids, shard, **kwargs)

    def decode_hidden(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        """:meth:`CausalLM.decode_hidden` with this snapshot's adapters."""
        self.activate()
        return self.base.decode_hidden(input_ids, batch)
