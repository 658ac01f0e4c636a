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


class _PermuteRows(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` of x's rows; backward ``grad[inverse]`` (no zero-filled scatter,
    which ``index_select``'s backward would allocate at the size of x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[order]``, differentiable through the inverse permutation (``inverse[order] = arange``)."""
    return _PermuteRows.apply(x, order, inverse)


class MixedAdapters:
    """What a base's :class:`~ringtune.models.lora.LoraSlot` adds while several runs share a pass: run ``r``'s
    adapters on the tokens whose index is ``r``.

    The local tokens are visited in run order once per module (``order``: run 0's tokens, run 1's, ..., then
    the tokens of no run), so each run's rows are a contiguous slice (a view, no copy); the runs' deltas are
    concatenated and put back in token order with one ``index_select`` (``inverse``). Per module: one gather
    of x, one of the delta, one add, whatever the number of runs.
    """

    def __init__(self, runs: Sequence[LoraAdapters], index: torch.Tensor) -> None:
        """``index`` int64 [T_local]: each local token's run (−1: none). Raises ValueError for a run that adapts
        routed experts (their rows are grouped by expert, not by token: such a run passes alone)."""
        self.runs = list(runs)
        if any(run.has_experts for run in self.runs):
            raise ValueError("a run with adapters on routed experts does not share a pass or a decode step")
        groups = [(index == r).nonzero().squeeze(1) for r in range(len(self.runs))]
        rest = (index < 0).nonzero().squeeze(1)
        self.counts = [int(g.numel()) for g in groups]
        self.spare = int(rest.numel())
        self.order = torch.cat([*groups, rest])
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        # the packer keeps a request's datums in order and the joined request lists the runs in order, so the
        # local tokens (whole rows or zigzag shards: sequences stay in order) are usually sorted already
        self.sorted = bool(torch.equal(self.order, torch.arange(self.order.numel(), device=self.order.device)))
        self.by_module: dict[str, list[int]] = {}
        for r, adapters in enumerate(self.runs):
            for module in adapters.by_module:
                self.by_module.setdefault(module, []).append(r)

    def to_runs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x's rows in run order, split per run (and the tokens of no run last): ``len(runs) + 1`` tensors.
        ``split`` (not slicing): its backward joins the parts' gradients once, instead of a zero-filled
        full-size gradient per part."""
        ordered = x if self.sorted else permute_rows(x, self.order, self.inverse)
        return list(ordered.split([*self.counts, self.spare]))

    def from_runs(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`to_runs`: the parts concatenated and put back in token order."""
        joined = torch.cat(parts)
        return joined if self.sorted else permute_rows(joined, self.inverse, self.order)

    def delta(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` [T_local, out] plus each run's delta on its own rows; ``x`` [T_local, in] (rows = local tokens).

        Every run with adapters on ``module`` takes part, with zero rows where this rank holds none of its
        tokens: every CP rank's autograd graph has the same shape."""
        if x.dim() != 2:
            raise ValueError(f"a mixed LoRA pass needs token-major [T, in] inputs at {module}; got {tuple(x.shape)}")
        rows = self.to_runs(x)
        having = set(self.by_module[module])
        width = out.shape[-1]
        parts = [
            self.runs[r].delta_only(module, rows[r]).to(out.dtype) if r in having else out.new_zeros(n, width)
            for r, n in enumerate(self.counts)
        ]
        parts.append(out.new_zeros(self.spare, width))
        return out + self.from_runs(parts)


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

    def _index(self, shard: PackedShard) -> torch.Tensor:
        index = shard.adapter_index
        if index is None or index.shape != (shard.plan.local_len,):
            got = None if index is None else tuple(index.shape)
            raise ValueError(f"a mixed LoRA pass needs shard.adapter_index int64 [{shard.plan.local_len}]; got {got}")
        if bool((index >= len(self.runs)).any()):
            raise ValueError(f"shard.adapter_index holds a run index >= {len(self.runs)} (the runs of this pass)")
        return index

    def forward(
        self, input_ids: torch.Tensor, shard: PackedShard, targets: torch.Tensor, upstream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Log-probs of ``targets`` [T_local] (or [T_local, K]) with each token's run's adapters and output
        weight; collective over the shard's CP group like :meth:`CausalLM.forward`. Tokens of no run (−1:
        the stream pad, whose targets are ignored) get log-prob 0.

        Every run's adapters and head take part on every rank, with zero rows where a rank holds none of
        the run's tokens, so the autograd graph, and with it the backward's CP collectives, is the same on
        every rank of the group."""
        mixed = MixedAdapters([run.adapters for run in self.runs], self._index(shard))
        self.slot.active = mixed  # stays active for a recomputing backward
        hidden = self.base.hidden_states(input_ids, shard)
        hidden_parts = mixed.to_runs(hidden)
        target_parts = mixed.to_runs(targets)
        upstream_parts = None if upstream is None else mixed.to_runs(upstream)
        parts = []
        for r, run in enumerate(self.runs):
            # every run, even with no token here (base weight, zero rows): the loss then always reaches
            # ``hidden``, so every CP rank runs the layers' backward collectives, a pad-only shard included
            weight = run.output_weight if mixed.counts[r] else self.base.output_weight
            up = None if upstream_parts is None else upstream_parts[r]
            parts.append(label_logprobs(hidden_parts[r], weight, target_parts[r], upstream=up))
        parts.append(parts[0].new_zeros((mixed.spare, *targets.shape[1:])))
        return mixed.from_runs(parts)
