"""Per-sequence decode caches, and their capture during a prefill forward over a packed row at CP = 1.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ringtune.errors import ParallelConfigError
from ringtune.layout.zigzag import ZigzagPlan


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
    """Everything needed to decode the token after the ``length`` tokens of one sequence (one entry per layer)."""

    length: int
    layers: list[LayerState]


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
        """k, v [T_local, Hkv, D] of the packed row (after norm and rotary): kept per sequence, real tokens only."""
        spans = self._owner.spans
        self.states = [AttentionState(k=k[s:e], v=v[s:e]) for s, e in spans]

    def record_gated_delta(self, final_state: torch.Tensor, conv_window: torch.Tensor) -> None:
        """final_state [m, Hv, Dk, Dv], conv_window [m, K−1, channels] of every segment of ``gdn_cu_seqlens``."""
        real = range(0, 2 * len(self._owner.spans), 2)  # segment 2i is sequence i's real part
        self.states = [GatedDeltaState(state=final_state[i], conv=conv_window[i]) for i in real]


class PrefillCapture:
    """Collects what decoding needs from a CP = 1 forward over a packed row of ``plan.seq_lens`` sequences.

    Pass it to :meth:`CausalLM.hidden_states` (``capture=``); afterwards :meth:`sequences` gives one
    :class:`SequenceCache` per sequence of the row, in row order.
    """

    def __init__(self, plan: ZigzagPlan, num_layers: int) -> None:
        if plan.cp_size != 1:
            raise ParallelConfigError(f"a prefill capture runs at cp_size=1; got cp_size={plan.cp_size}")
        self.plan = plan
        self.layers = [LayerCapture(self) for _ in range(num_layers)]

    @cached_property
    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every sequence's real tokens in the local stream."""
        return [(s, s + n) for s, n in zip(self.plan.local_starts, self.plan.seq_lens, strict=True)]

    @cached_property
    def gdn_cu_seqlens(self) -> torch.Tensor:
        """int64: the row's bounds with each sequence cut at its real end: ``[s0, e0, s1, e1, …, real_len (, len)]``.

        Segment 2i is sequence i's real tokens, segment 2i+1 its tail pad (maybe empty), then the stream pad.
        """
        bounds = [b for span in self.spans for b in span] + [self.plan.real_local_len]
        if self.plan.stream_pad_len:
            bounds.append(self.plan.local_len)
        return torch.tensor(bounds, dtype=torch.int64)

    def sequences(self) -> list[SequenceCache]:
        """One :class:`SequenceCache` per sequence (views into the prefill's tensors); every layer must have run."""
        missing = [i for i, layer in enumerate(self.layers) if layer.states is None]
        if missing:
            raise RuntimeError(f"layers {missing} recorded nothing: run hidden_states(..., capture=this) first")
        return [
            SequenceCache(length=n, layers=[layer.states[i] for layer in self.layers])  # type: ignore[index]
            for i, n in enumerate(self.plan.seq_lens)
        ]
