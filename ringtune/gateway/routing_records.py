"""The gateway's routing records for replay (R3): which experts the sampler used for each recently sampled sequence.

With ``ringtune serve --routing-replay`` on a MoE model, every sampled sequence comes back with its routing
(:attr:`~ringtune.sample.sampler.SampledSequence.routing`: per token fed, prompt + tokens[:-1], the k experts of
each MoE layer). :class:`RoutingRecords` keeps them by token sequence, and each datum of a later ``forward`` /
``forward_backward`` of any run on this server is matched against them:

- **Match rule**: the longest recorded sequence that is a prefix of the datum's ``model_input`` tokens (equal
  token for token). An RL datum is ``prompt + completion[:-1]``, exactly what its sample recorded; a multi-turn
  datum's last turn was sampled from a prompt holding every earlier turn, so its record covers the whole datum.
  Positions past the matched prefix (and datums with no match) keep the router's own choice (−1 rows).
- **Bounds**: at most ``max_tokens`` recorded tokens are kept; the least recently added or matched go first.
  A record is dropped silently when evicted: replay is an optimisation of the numerics, never required.

One thread only (the gateway's backend thread records and matches).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from ringtune.engine.batch import TrainDatum

_MOD = (1 << 61) - 1
_BASE = 1_000_003

DEFAULT_MAX_TOKENS = 1 << 20
"""Recorded tokens kept by default (a record costs MoE layers x k x 2 bytes per token)."""


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """Polynomial hashes of every prefix: entry i is the hash of ``tokens[: i + 1]``."""
    out, h = [], 0
    for t in tokens:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


class RoutingRecords:
    """Recorded routing by token sequence (module docstring)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._records: OrderedDict[tuple[int, int], tuple[list[int], torch.Tensor]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._records)

    def add(self, tokens: Sequence[int], routing: torch.Tensor) -> None:
        """Record ``routing`` [len(tokens), L, k] for the sequence ``tokens`` (the tokens fed to the model)."""
        if routing.shape[0] != len(tokens) or not len(tokens):
            raise ValueError(f"routing has {routing.shape[0]} rows for {len(tokens)} tokens")
        key = (len(tokens), prefix_hashes(tokens)[-1])
        old = self._records.pop(key, None)
        if old is not None:
            self._tokens -= len(old[0])
        self._records[key] = (list(tokens), routing)
        self._tokens += len(tokens)
        while self._tokens > self.max_tokens and self._records:
            _, (dropped, _) = self._records.popitem(last=False)
            self._tokens -= len(dropped)

    def lookup(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """int64 [len(tokens), L, k]: the longest recorded prefix's routing, −1 rows after it; None if none."""
        if not self._records:
            return None
        tokens = list(tokens)
        for n, h in reversed(list(enumerate(prefix_hashes(tokens), start=1))):
            found = self._records.get((n, h))
            if found is None or found[0] != tokens[:n]:
                continue
            self._records.move_to_end((n, h))
            routing = found[1]
            out = torch.full((len(tokens), *routing.shape[1:]), -1, dtype=torch.int64, device=routing.device)
            out[:n] = routing.to(torch.int64)
            return out
        return None


def attach_routing(data: list[TrainDatum], records: RoutingRecords) -> tuple[list[TrainDatum], int]:
    """``data`` with each matching datum's ``routing`` set (:meth:`RoutingRecords.lookup`), and how many tokens
    got a recorded routing. A datum that already has one (resolved from its provenance) keeps it. A datum with
    images gets none: its image-pad tokens do not say which image they were (two images of one size give the same
    tokens), so a token match is no evidence of the same sequence."""
    out, replayed = [], 0
    for datum in data:
        if datum.routing is not None or datum.images:
            out.append(datum)
            continue
        routing = records.lookup(datum.tokens.tolist())
        if routing is not None:
            replayed += int((routing[:, 0, 0] >= 0).sum())
            datum = replace(datum, routing=routing)
        out.append(datum)
    return out, replayed
