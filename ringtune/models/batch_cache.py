"""The decode batch: the caches of B sequences side by side, one row per sequence, of different lengths.

Row ``b`` holds a sequence of ``lengths[b]`` tokens. Per layer:

- attention: :class:`KVRows`, padded buffers ``k, v [B, Hkv, capacity, D]``; slots ``< lengths[b]`` hold row
  b's keys/values, the rest are ignored (decode attention masks them). Capacity grows by a quarter (at least
  64 slots) when a step needs it, so appending is amortised O(1) per token.
- GatedDeltaNet: :class:`GatedDeltaRows`, ``state [B, Hv, Dk, Dv]`` and ``conv [B, K−1, channels]``.

Sequences join (:meth:`DecodeBatch.join`, from their :class:`SequenceCache`) and leave (:meth:`DecodeBatch.keep`)
between steps; both copy the rows, which happens once per sequence, not per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ringtune.models.cache import AttentionState, GatedDeltaState, SequenceCache

GROWTH_MIN = 64
"""Slots added at least when the KV capacity grows."""


def _grown(need: int) -> int:
    return need + max(GROWTH_MIN, need // 4)


@dataclass
class KVRows:
    """One attention layer's cache for the batch: ``k``, ``v`` [B, Hkv, capacity, D] in the model dtype."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @classmethod
    def of(cls, states: list[AttentionState], capacity: int) -> KVRows:
        """Rows from per-sequence states (each ``[n, Hkv, D]``, n ≤ capacity)."""
        first = states[0].k
        shape = (len(states), first.shape[1], capacity, first.shape[2])
        k, v = first.new_zeros(shape), first.new_zeros(shape)
        for b, s in enumerate(states):
            n = s.k.shape[0]
            k[b, :, :n] = s.k.transpose(0, 1)
            v[b, :, :n] = s.v.transpose(0, 1)
        return cls(k, v)

    def resized(self, capacity: int) -> KVRows:
        """The same rows with ``capacity`` slots (≥ every row's length; new slots are zeros)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return KVRows(self.k[:, :, :capacity], self.v[:, :, :capacity])
        return KVRows(F.pad(self.k, (0, 0, 0, extra)), F.pad(self.v, (0, 0, 0, extra)))

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """In place: row b's new key/value (``k, v`` [B, Hkv, D]) into slot ``positions[b]``."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, positions] = k
        self.v[rows, :, positions] = v

    def state(self, b: int, length: int) -> AttentionState:
        return AttentionState(k=self.k[b, :, :length].transpose(0, 1), v=self.v[b, :, :length].transpose(0, 1))


@dataclass
class GatedDeltaRows:
    """One GDN layer's cache for the batch: ``state`` [B, Hv, Dk, Dv], ``conv`` [B, K−1, channels]."""

    state: torch.Tensor
    conv: torch.Tensor

    @classmethod
    def of(cls, states: list[GatedDeltaState]) -> GatedDeltaRows:
        return cls(torch.stack([s.state for s in states]), torch.stack([s.conv for s in states]))

    def state_of(self, b: int) -> GatedDeltaState:
        return GatedDeltaState(state=self.state[b], conv=self.conv[b])


LayerRows = KVRows | GatedDeltaRows


class DecodeBatch:
    """The caches of the sequences being decoded together (rows), in row order.

    Attributes:
        lengths: int64 [B], tokens already in each row's cache (the next token's slot).
        layers: one :class:`KVRows` or :class:`GatedDeltaRows` per decoder layer.
        rope_offsets: int64 [B], each row's :attr:`SequenceCache.rope_offset`: the next token is rotated at
            ``lengths + rope_offsets`` (0 for text-only rows).
    """

    def __init__(
        self, lengths: torch.Tensor, layers: list[LayerRows], rope_offsets: torch.Tensor | None = None
    ) -> None:
        self.lengths = lengths
        self.layers = layers
        self.rope_offsets = torch.zeros_like(lengths) if rope_offsets is None else rope_offsets

    @classmethod
    def of(cls, caches: list[SequenceCache], *, reserve: int = 0) -> DecodeBatch:
        """A batch of ``caches`` (at least one), with room for ``reserve`` more tokens per row before growing."""
        if not caches:
            raise ValueError("a DecodeBatch needs at least one sequence")
        lengths = torch.tensor([c.length for c in caches], dtype=torch.int64, device="cpu")
        capacity = _grown(int(lengths.max()) + reserve)
        layers: list[LayerRows] = []
        for i, first in enumerate(caches[0].layers):
            states = [c.layers[i] for c in caches]
            if isinstance(first, AttentionState):
                layers.append(KVRows.of(states, capacity))  # type: ignore[arg-type]
            else:
                layers.append(GatedDeltaRows.of(states))  # type: ignore[arg-type]
        offsets = torch.tensor([c.rope_offset for c in caches], dtype=torch.int64, device="cpu")
        return cls(lengths, layers, offsets)

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def reserve(self, steps: int = 1) -> None:
        """Make room for ``steps`` more tokens in every row (grows the KV buffers when needed)."""
        need = int(self.lengths.max()) + steps if len(self) else 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVRows) and layer.capacity < need:
                self.layers[i] = layer.resized(_grown(need))

    def advance(self) -> None:
        """Every row took one token (after a decode step wrote its K/V and states)."""
        self.lengths = self.lengths + 1

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); the others leave the batch."""
        index = torch.tensor(rows, dtype=torch.int64, device="cpu")
        self.lengths = self.lengths[index]
        self.rope_offsets = self.rope_offsets[index]
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVRows):
                self.layers[i] = KVRows(layer.k[index.to(layer.k.device)], layer.v[index.to(layer.k.device)])
            else:
                dev = layer.state.device
                self.layers[i] = GatedDeltaRows(layer.state[index.to(dev)], layer.conv[index.to(dev)])

    def join(self, caches: list[SequenceCache]) -> None:
        """Append one row per cache (after the existing rows)."""
        if not caches:
            return
        new = DecodeBatch.of(caches)
        if not len(self):
            self.lengths, self.layers, self.rope_offsets = new.lengths, new.layers, new.rope_offsets
            return
        self.lengths = torch.cat([self.lengths, new.lengths])
        self.rope_offsets = torch.cat([self.rope_offsets, new.rope_offsets])
        for i, (old, add) in enumerate(zip(self.layers, new.layers, strict=True)):
            if isinstance(old, KVRows) and isinstance(add, KVRows):
                capacity = max(old.capacity, add.capacity)
                a, b = old.resized(capacity), add.resized(capacity)
                self.layers[i] = KVRows(torch.cat([a.k, b.k]), torch.cat([a.v, b.v]))
            elif isinstance(old, GatedDeltaRows) and isinstance(add, GatedDeltaRows):
                self.layers[i] = GatedDeltaRows(torch.cat([old.state, add.state]), torch.cat([old.conv, add.conv]))
            else:
                raise ValueError(f"layer {i}: a joining sequence's cache is of another layer type")

    def sequence(self, b: int) -> SequenceCache:
        """Row ``b`` as a :class:`SequenceCache` (views), e.g. to continue it elsewhere."""
        n = int(self.lengths[b])
        layers = [
            layer.state(b, n) if isinstance(layer, KVRows) else layer.state_of(b)  # type: ignore[union-attr]
            for layer in self.layers
        ]
        return SequenceCache(length=n, layers=layers, rope_offset=int(self.rope_offsets[b]))  # type: ignore[arg-type]
