"""Several LoRA runs in one forward pass over their shared frozen base (multi-adapter batching, as S-LoRA and
punica do it for serving; here for training too).

The runs' datums are packed into the same THD rows; each token carries the index of the run it belongs to
(``PackedShard.adapter_index``, zigzag-sliced like the tokens, −1 on the stream pad). The base's layers run
once over every token; each targeted linear's hook adds, for every run, ``scale · B(A(x))`` of that run's
adapters on that run's tokens only (:class:`MixedAdapters`), and the log-prob head reads each run's own
output weight for its tokens. A token never sees another run's adapters, so each run's log-probs and
adapter gradients are the ones it would get alone (the base is frozen: nothing else is trained), while the
base's matmuls, attention and collectives run once for all of them.

Everything the base computes per token is unchanged; what the runs share is the pass. Attention and
GatedDeltaNet mix tokens only within a sequence, and a sequence belongs to one datum, hence to one run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ringtune.models.logprob_head import label_logprobs
from ringtune.models.lora import LoraAdapters, LoraModel, lora_slot
from ringtune.models.shard import PackedShard


class MixedAdapters:
    """What a base's :class:`~ringtune.models.lora.LoraSlot` adds while several runs share a pass: run ``r``'s
    adapters on the tokens whose ``adapter_index`` is ``r`` (``token_groups[r]``: int64 local token indices)."""

    def __init__(self, runs: Sequence[LoraAdapters], token_groups: Sequence[torch.Tensor]) -> None:
        self.runs = list(runs)
        self.token_groups = list(token_groups)
        self.by_module: dict[str, list[int]] = {}
        for r, adapters in enumerate(self.runs):
            for module in adapters.by_module:
                self.by_module.setdefault(module, []).append(r)

    def delta(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` [T_local, out] plus each run's delta on its own rows; ``x`` [T_local, in] (rows = local tokens)."""
        if x.dim() != 2:
            raise ValueError(f"a mixed LoRA pass needs token-major [T, in] inputs at {module}; got {tuple(x.shape)}")
        for r in self.by_module[module]:  # an empty group too: every CP rank's graph has the same collectives
            rows = self.token_groups[r]
            out = out.index_add(0, rows, self.runs[r].delta_only(module, x[rows]).to(out.dtype))
        return out


class MixedLoraModel(nn.Module):
    """LoRA runs on one shared base, run as one model by the trainer (``Trainer.view``): quacks like
    :class:`~ringtune.models.lora.LoraModel` (``config``, ``model`` = the base's body, ``forward`` on a
    :class:`PackedShard` whose ``adapter_index`` says each token's run). Its parameters are every run's
    adapters (``runs.<r>.adapters...``).

    Raises ValueError when the runs do not share one base object.
    """

    def __init__(self, runs: Sequence[LoraModel]) -> None:
        super().__init__()
        if not runs:
            raise ValueError("a mixed LoRA pass needs at least one run")
        base = runs[0].base
        if any(run.base is not base for run in runs):
            raise ValueError("the runs of a mixed LoRA pass must share one base model")
        object.__setattr__(self, "base", base)
        self.config = base.config
        self.slot = lora_slot(base)
        self.runs = nn.ModuleList(runs)

    @property
    def model(self) -> nn.Module:
        return self.base.model

    def check_parallel(self, shard: PackedShard) -> None:
        self.base.check_parallel(shard)

    def _groups(self, shard: PackedShard) -> list[torch.Tensor]:
        index = shard.adapter_index
        if index is None or index.shape != (shard.plan.local_len,):
            got = None if index is None else tuple(index.shape)
            raise ValueError(f"a mixed LoRA pass needs shard.adapter_index int64 [{shard.plan.local_len}]; got {got}")
        if bool((index >= len(self.runs)).any()):
            raise ValueError(f"shard.adapter_index holds a run index >= {len(self.runs)} (the runs of this pass)")
        return [(index == r).nonzero().squeeze(1) for r in range(len(self.runs))]

    def forward(
        self, input_ids: torch.Tensor, shard: PackedShard, targets: torch.Tensor, upstream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Log-probs of ``targets`` [T_local] (or [T_local, K]) with each token's run's adapters and output
        weight; collective over the shard's CP group like :meth:`CausalLM.forward`. Tokens of no run (−1:
        the stream pad, whose targets are ignored) get log-prob 0.

        Every run's adapters and head take part on every rank, with zero rows where a rank holds none of
        the run's tokens, so the autograd graph, and with it the backward's CP collectives, is the same on
        every rank of the group."""
        groups = self._groups(shard)
        self.slot.active = MixedAdapters([run.adapters for run in self.runs], groups)  # also for recompute
        hidden = self.base.hidden_states(input_ids, shard)
        lp = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        for run, rows in zip(self.runs, groups, strict=True):
            # every run, even with no token here (base weight, zero rows): the loss then always reaches
            # ``hidden``, so every CP rank runs the layers' backward collectives, a pad-only shard included
            weight = run.output_weight if rows.numel() else self.base.output_weight
            part = label_logprobs(
                hidden[rows], weight, targets[rows], upstream=None if upstream is None else upstream[rows]
            )
            lp = lp.to(part.dtype).index_copy(0, rows, part)
        return lp
