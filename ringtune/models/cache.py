"""Per-sequence decode caches, and their capture during a prefill forward over a packed row (any CP size).

What decoding continues from, per layer of one sequence of ``length`` tokens:

- attention layer: :class:`AttentionState`, the keys and values of every token so far (after the q/k norm
  and rotary, as attention reads them), ``[length, Hkv, D]`` each, in the model dtype;
- GatedDeltaNet layer: :class:`GatedDeltaState`, the recurrent state ``[Hv, Dk, Dv]`` after the last token
  (float32, float64 for a float64 model) and the conv window, the last K−1 raw ``mixed_qkv`` inputs
  ``[K−1, channels]`` (zeros in front of a shorter sequence), in the model dtype.

A prefill is the training forward (:meth:`CausalLM.hidden_states`) with a :class:`PrefillCapture`: each layer
hands its K/V (attention) or final states and windows (GDN) to its :class:`LayerCapture`, which cuts them
per sequence. At CP = 1 the zigzag layout still pads every sequence to an even length (a tail pad after the
real tokens that no real token sees); the capture gives GDN layers segment bounds that end each real part
before its pad (:attr:`PrefillCapture.gdn_cu_seqlens`), so the final state is the one after the last real
token, while the real tokens' outputs are those of the training forward (the pad is causally after them).

At CP > 1 (a long prompt prefilled by the whole CP group, :mod:`ringtune.sample.mesh_prompts`) each rank
holds a zigzag shard. An attention layer's K/V shards are put back in row order by one SUM all-reduce over
the CP group (:func:`ringtune.parallel.row_gather.gather_row`: each token has one owner, so the sum is exact). A
GatedDeltaNet layer's raw inputs (q, k, v, g, beta before the conv) are gathered the same way and the rank
runs :func:`gated_delta_prefill` over the sequences it keeps for their final states and conv windows (linear
in their tokens; the layer's output still comes from its CP mode). Every rank of the group takes part; a rank keeps
only the sequences it will decode (``keep``), so the full caches of the others are transient.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from ringtune.errors import ParallelConfigError
from ringtune.layout.zigzag import ZigzagPlan
from ringtune.ops.gated_delta.prefill import gated_delta_prefill
from ringtune.parallel.row_gather import gather_row


@dataclass
class AttentionState:
    """One sequence's keys and values for one attention layer: ``k``, ``v`` [length, Hkv, D]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class GatedDeltaState:
    """One sequence's GDN layer state: ``state`` [Hv, Dk, Dv] (compute dtype), ``conv`` [K−1, channels]."""

    state: torch.Tensor
    conv: torch.Tensor


LayerState = AttentionState | GatedDeltaState


@dataclass
class SequenceCache:
    """Everything needed to decode the token after the ``length`` tokens of one sequence (one entry per layer).

    ``rope_offset`` (<= 0): the next token's rotary position minus ``length``; nonzero after images, whose tokens
    advance the MRoPE count by less than their number (:func:`ringtune.layout.mrope.rope_offsets`).
    """

    length: int
    layers: list[LayerState]
    rope_offset: int = 0


class LayerCapture:
    """Receives one layer's prefill tensors from its forward and cuts them per sequence."""

    def __init__(self, owner: PrefillCapture) -> None:
        self._owner = owner
        self.states: list[LayerState] | None = None

    @property
    def gdn_cu_seqlens(self) -> torch.Tensor:
        """Segment bounds a GDN layer runs on during the capture (see :attr:`PrefillCapture.gdn_cu_seqlens`)."""
        return self._owner.gdn_cu_seqlens

    def record_attention(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T_local, Hkv, D] of this rank's part of the row (after norm and rotary): kept per sequence,
        real tokens only. At CP > 1 gathered to the whole row first (collective over the CP group)."""
        owner = self._owner
        if owner.plan.cp_size > 1:
            k, v = gather_row(k.detach(), owner.plan, owner.group), gather_row(v.detach(), owner.plan, owner.group)
        self.states = [
            AttentionState(k=k[s:e], v=v[s:e]) if i in owner.keep else None  # type: ignore[misc]
            for i, (s, e) in enumerate(owner.spans)
        ]

    def record_gated_delta(self, final_state: torch.Tensor, conv_window: torch.Tensor) -> None:
        """final_state [m, Hv, Dk, Dv], conv_window [m, K−1, channels] of every segment of ``gdn_cu_seqlens``."""
        real = range(0, 2 * len(self._owner.spans), 2)  # segment 2i is sequence i's real part
        self.states = [GatedDeltaState(state=final_state[i], conv=conv_window[i]) for i in real]

    def record_gated_delta_inputs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weight: torch.Tensor,
    ) -> None:
        """CP > 1: a GDN layer's raw inputs of this rank's zigzag shard (q, k [T_local, Hk, Dk], v [T_local,
        Hv, Dv], g, beta [T_local, Hv]); gathered to the row (collective over the CP group), then the final
        states and conv windows of the kept sequences by :func:`gated_delta_prefill` on them alone (each
        rank scans only what it decodes), one segment per sequence."""
        owner = self._owner
        plan, group = owner.plan, owner.group
        q, k, v, g, beta = (gather_row(x.detach(), plan, group) for x in (q, k, v, g, beta))
        kept = sorted(owner.keep)
        self.states = [None] * len(plan.seq_lens)  # type: ignore[list-item]
        if not kept:
            return
        spans = [owner.spans[i] for i in kept]
        rows = torch.cat([torch.arange(s, e, device=q.device) for s, e in spans]).to(q.device)
        bounds = torch.tensor([0, *itertools.accumulate(e - s for s, e in spans)], device="cpu")
        q, k, v, g, beta = (x.index_select(0, rows) for x in (q, k, v, g, beta))
        _, final, window = gated_delta_prefill(q, k, v, bounds, g=g, beta=beta, conv_weight=conv_weight)
        for j, i in enumerate(kept):
            self.states[i] = GatedDeltaState(state=final[j], conv=window[j])


class PrefillCapture:
    """Collects what decoding needs from a forward over a packed row of ``plan.seq_lens`` sequences.

    Pass it to :meth:`CausalLM.hidden_states` (``capture=``) with the shard built on the same ``plan``;
    afterwards :meth:`sequences` gives one :class:`SequenceCache` per sequence of the row, in row order
    (None for a sequence not in ``keep``).

    Args:
        plan: this rank's plan of the row.
        num_layers: the model's decoder layers.
        group: the CP group (required when ``plan.cp_size > 1``; every rank of it runs the forward).
        keep: indices of the sequences whose caches this rank keeps (default: all).
    """

    def __init__(
        self,
        plan: ZigzagPlan,
        num_layers: int,
        *,
        group: dist.ProcessGroup | None = None,
        keep: set[int] | None = None,
    ) -> None:
        if plan.cp_size > 1 and group is None:
            raise ParallelConfigError(f"a prefill capture at cp_size={plan.cp_size} needs the CP group")
        self.plan, self.group = plan, group
        self.keep = set(range(len(plan.seq_lens))) if keep is None else set(keep)
        self.layers = [LayerCapture(self) for _ in range(num_layers)]
        self.rope_offsets = [0] * len(plan.seq_lens)  # set by the forward for a row with images

    @cached_property
    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every sequence's real tokens: in the local stream at CP = 1, in the gathered
        row at CP > 1."""
        starts = self.plan.local_starts if self.plan.cp_size == 1 else self.plan.row_starts
        return [(s, s + n) for s, n in zip(starts, self.plan.seq_lens, strict=True)]

    @cached_property
    def gdn_cu_seqlens(self) -> torch.Tensor:
        """int64: the row's bounds with each sequence cut at its real end: ``[s0, e0, s1, e1, …, real_len (, len)]``.

        Segment 2i is sequence i's real tokens, segment 2i+1 its tail pad (maybe empty), then the stream pad.
        """
        bounds = [b for span in self.spans for b in span] + [self.plan.real_local_len]
        if self.plan.stream_pad_len:
            bounds.append(self.plan.local_len)
        return torch.tensor(bounds, dtype=torch.int64, device="cpu")

    def sequences(self) -> list[SequenceCache | None]:
        """One :class:`SequenceCache` per sequence (views into the prefill's tensors), None for one not kept;
        every layer must have run."""
        missing = [i for i, layer in enumerate(self.layers) if layer.states is None]
        if missing:
            raise RuntimeError(f"layers {missing} recorded nothing: run hidden_states(..., capture=this) first")
        return [
            SequenceCache(
                length=n,
                layers=[layer.states[i] for layer in self.layers],  # type: ignore[index,misc]
                rope_offset=self.rope_offsets[i],
            )
            if i in self.keep
            else None
            for i, n in enumerate(self.plan.seq_lens)
        ]
