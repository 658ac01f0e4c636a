"""One decode batch per base model on a rank, shared by every generation on it: continuous batching across
sampling requests, and several LoRA adapters in one decode step (multi-adapter decoding, as S-LoRA and
punica serve it).

Each :class:`~ringtune.sample.sampler.Generation` prefills its prompts on its own model and puts its rows in
the :class:`SharedDecode` of that model's base (:func:`decode_base`: a LoRA snapshot's shared frozen base,
else the model itself). One :meth:`SharedDecode.step` feeds every row's newest token through the base once
(:meth:`CausalLM.decode_hidden`, the rows' caches side by side in one
:class:`~ringtune.models.batch_cache.DecodeBatch`):

- rows of one model only: that model's own decode (a LoRA snapshot activates its adapters);
- rows of several LoRA snapshots (and of the base itself): the base's LoRA hooks add, on each row, the
  adapters of that row's snapshot only (:class:`~ringtune.models.lora_mixed.MixedAdapters`, the per-token
  run index of a joined training pass; −1 for a row of the base: no adapter).

Then each generation chooses its own rows' next tokens with its own head weight (a snapshot's adapted
unembedding), sampling parameters, generators and stop rules (``DecodeOwner.take``); rows that stopped leave
the batch. Nothing a row computes reads another row (per-row caches, positions, generators), so sharing
changes throughput, not tokens, up to the kernels' batch-size variance in float32/bfloat16 (float64 agrees
to 1e-10, tests/test_shared_decode.py).

A failed step leaves the rows' caches half-written: every generation with rows in it then fails with that
error (:meth:`DecodeOwner.fail`), none is dropped silently. A generation that is abandoned (its job failed on
another rank) takes its rows out with :meth:`SharedDecode.leave`.

Single process, no collectives: each rank decodes its own share of the requests.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ringtune.models.batch_cache import DecodeBatch
from ringtune.models.cache import SequenceCache
from ringtune.models.layers.moe import capturing_routing
from ringtune.models.lora import LoraSlot
from ringtune.models.lora_mixed import MixedAdapters
from ringtune.models.lora_snapshot import LoraSnapshot
from ringtune.sample.prefill import output_logits


class DecodeRow(Protocol):
    """What the shared batch reads of a row: its tokens (the newest one is fed next) and, when it records
    MoE routing, the list each step's expert ids are appended to."""

    tokens: list[int]
    routing: list[torch.Tensor] | None


class DecodeOwner(Protocol):
    """A generation whose rows are in a :class:`SharedDecode`."""

    model: Any  # a CausalLM, or a LoraSnapshot on the shared base
    weight: torch.Tensor  # [V, D] head weight its logits are computed with (float32/float64)
    record_routing: bool

    def take(self, rows: list[Any], logits: torch.Tensor) -> list[int]:
        """Choose each row's next token from ``logits`` [len(rows), V]; the indices of the rows that go on."""
        ...

    def fail(self, error: BaseException) -> None:
        """Its rows were dropped because a shared step failed with ``error``."""
        ...


def decode_base(model: nn.Module) -> nn.Module:
    """The model whose layers decode ``model``'s rows: a LoRA snapshot's base, else ``model`` itself (also a
    snapshot with adapters on routed experts: those rows decode in a batch of their own)."""
    if isinstance(model, LoraSnapshot) and not model.adapters.has_experts:
        return model.base
    return model


@dataclass
class DecodeStats:
    """What a rank's shared decode batches did: ``steps`` (forwards of a base), ``rows`` (row-steps: tokens
    decoded), the most rows and the most models (LoRA snapshots, the base) seen in one step."""

    steps: int = 0
    rows: int = 0
    peak_rows: int = 0
    peak_models: int = 0

    def seen(self, rows: int, models: int) -> None:
        self.steps += 1
        self.rows += rows
        self.peak_rows = max(self.peak_rows, rows)
        self.peak_models = max(self.peak_models, models)


class SharedDecode:
    """The rows of every generation decoding on one base model (row order = join order) and their caches."""

    def __init__(self, base: nn.Module, stats: DecodeStats | None = None) -> None:
        self.base = base
        self.rows: list[DecodeRow] = []
        self.owners: list[DecodeOwner] = []  # per row
        self.batch: DecodeBatch | None = None
        self.stats = stats if stats is not None else DecodeStats()

    def __len__(self) -> int:
        return len(self.rows)

    def count(self, owner: DecodeOwner) -> int:
        """Rows ``owner`` has in the batch."""
        return sum(o is owner for o in self.owners)

    def join(self, owner: DecodeOwner, rows: Sequence[DecodeRow], caches: list[SequenceCache], reserve: int) -> None:
        """Append ``owner``'s ``rows`` with their prefill ``caches`` (``reserve`` KV slots per row when the
        batch is new). Raises ValueError when ``owner.model`` decodes on another base."""
        if decode_base(owner.model) is not self.base:
            raise ValueError("a generation joins the shared decode batch of its own model's base only")
        if not rows:
            return
        if self.batch is None:
            self.batch = DecodeBatch.of(caches, reserve=reserve)
        else:
            self.batch.join(caches)
        self.rows.extend(rows)
        self.owners.extend([owner] * len(rows))

    def leave(self, owner: DecodeOwner) -> None:
        """Take ``owner``'s rows out (it no longer decodes: abandoned or failed)."""
        self._keep([b for b, o in enumerate(self.owners) if o is not owner])

    def step(self) -> None:
        """One decode step of every row (see the module docstring); each owner takes its rows' tokens.

        Raises what the step raised, after failing every owner with rows here (their caches are unusable)."""
        if not self.rows:
            return
        assert self.batch is not None
        try:
            recording = any(o.record_routing for o in self.owners)
            with capturing_routing(self.base) if recording else nullcontext() as captured:
                hidden = self._decode_hidden()
            routing = None
            if recording:
                routing = torch.stack([layer[0] for layer in captured], dim=1).to(torch.int16).cpu()  # [B, L, k]
            alive: list[int] = []
            for owner, members in self._by_owner().items():
                rows = [self.rows[b] for b in members]
                if routing is not None:
                    for b, row in zip(members, rows, strict=True):
                        if row.routing is not None:
                            row.routing.append(routing[b : b + 1])
                index = torch.tensor(members, dtype=torch.int64, device=hidden.device)
                logits = output_logits(hidden.index_select(0, index), owner.weight)
                alive.extend(members[i] for i in owner.take(rows, logits))
        except BaseException as exc:
            for owner in dict.fromkeys(self.owners):
                owner.fail(exc)
            self.rows, self.owners, self.batch = [], [], None
            raise
        self._keep(sorted(alive))

    def _by_owner(self) -> dict[DecodeOwner, list[int]]:
        groups: dict[DecodeOwner, list[int]] = {}
        for b, owner in enumerate(self.owners):
            groups.setdefault(owner, []).append(b)
        return groups

    def _decode_hidden(self) -> torch.Tensor:
        """hidden [B, D] of every row's newest token (the batch's caches advance by one)."""
        assert self.batch is not None
        device = self.base.output_weight.device
        ids = torch.tensor([row.tokens[-1] for row in self.rows], dtype=torch.int64, device=device)
        models = list(dict.fromkeys(o.model for o in self.owners))
        self.stats.seen(len(self.rows), len(models))
        if len(models) == 1 and isinstance(models[0], LoraSnapshot):
            return models[0].decode_hidden(ids, self.batch)  # its adapters on every row
        slot = getattr(self.base, "_lora_slot", None)
        if slot is None:  # a base without LoRA hooks: its own rows only
            return self.base.decode_hidden(ids, self.batch)
        with _adapters_per_row(slot, self.base, models, [models.index(o.model) for o in self.owners]):
            return self.base.decode_hidden(ids, self.batch)

    def _keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in rows]
        self.owners = [self.owners[b] for b in rows]
        if not rows:
            self.batch = None
        elif self.batch is not None:
            self.batch.keep(rows)


@contextmanager
def _adapters_per_row(slot: LoraSlot, base: nn.Module, models: list[Any], model_of_row: list[int]) -> Iterator[None]:
    """While active, the base's LoRA hooks (``slot``) add on row b the adapters of ``models[model_of_row[b]]``
    (nothing on a row of the base itself); the slot's previous adapters are put back after."""
    if any(m is not base and not isinstance(m, LoraSnapshot) for m in models):
        raise ValueError("rows of different models share a decode step only as LoRA snapshots of one base")
    snapshots = [m for m in models if isinstance(m, LoraSnapshot)]
    run_of_model = [snapshots.index(m) if isinstance(m, LoraSnapshot) else -1 for m in models]
    index = torch.tensor([run_of_model[i] for i in model_of_row], dtype=torch.int64, device=base.output_weight.device)
    before = slot.active
    slot.active = MixedAdapters([s.adapters for s in snapshots], index)
    try:
        yield
    finally:
        slot.active = before


class SharedDecodes:
    """This rank's shared decode batches, one per base model with rows (``enabled`` False: every generation
    gets a batch of its own, as before sharing; the ``--no-shared-decode`` measurement baseline)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.stats = DecodeStats()
        self._by_base: dict[int, SharedDecode] = {}  # id(base): the entry holds the base, so the id is stable

    def for_model(self, model: nn.Module) -> SharedDecode:
        """The batch ``model``'s rows join: the one its base has if it has rows, else a new one. Empty
        batches are forgotten here (they would keep an evicted snapshot's model alive)."""
        base = decode_base(model)
        if not self.enabled:
            return SharedDecode(base, self.stats)
        self._by_base = {key: shared for key, shared in self._by_base.items() if len(shared)}
        shared = self._by_base.get(id(base))
        if shared is None:
            shared = self._by_base[id(base)] = SharedDecode(base, self.stats)
        return shared
