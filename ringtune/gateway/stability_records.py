"""What the sampler recorded for each sequence sampled with ``record_stability_info=True`` (stable_reinforce).

A sampling client made with ``record_stability_info=True`` sends the flag on every ``asample``; each sequence of
such a request is recorded here under its ``sequence_id`` (the id ``asample`` answers at once, which the SDK
stamps on the returned ``SampledSequence``): its prompt, its sampled tokens, the float32 log-prob the client got
for each, and, when the sampler records MoE routing (``--routing-replay``), the experts each fed token used. A
training datum's provenance spans name these ids (:mod:`ringtune.gateway.provenance`).

- **Scope and expiry**: records are kept per sampling session; a session's records expire a day
  (:data:`DEFAULT_TTL_S`) after the session's last use (a sample recorded into it, or a training request that
  resolved one of its sequences). Lookups are by ``sequence_id`` alone (ids are unique on this server, across
  restarts: they hold the request's random id), so a client may train on them from another session.
- **Memory bound**: at most ``max_tokens`` tokens (prompt + sampled, per sequence) are held; the least recently
  added or used sequence goes first. A training request that names an evicted or expired sequence is refused
  as a ``user`` error naming it.
- **Persistence**: with a ``directory`` (``<checkpoint root>/.stability_records``, where the runs are) each
  record is appended to its session's file (one JSON line per sequence) as it is made, and a session's file
  time is its last use. A new server reads the unexpired files back (newest first, up to ``max_tokens``),
  rewrites them with what it kept, and deletes expired ones.

One thread only (the gateway's backend thread records and resolves).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1 << 22
"""Tokens (prompt + sampled, per sequence) held by default: about 4 M, tens of MB for a dense model."""

DEFAULT_TTL_S = 24 * 3600.0
"""A session's records live this long after its last use."""

DIRECTORY_NAME = ".stability_records"
"""Under the checkpoint root; the leading dot keeps it apart from run directories (run ids never start with one)."""


@dataclass(frozen=True)
class SequenceRecord:
    """One recorded sequence: ``prompt`` and ``tokens`` (ids), ``logprobs`` (float32 values, one per sampled
    token, exactly as the client received them), ``routing`` int [len(prompt) + len(tokens) - 1, L, k] (the
    experts of every fed token) or None, and the sampling ``session`` it belongs to."""

    session: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    routing: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.tokens)


def _file_name(session: str) -> str:
    """A file name for a sampling session id (``<session>:sample:<n>:<hex>``): unsafe characters as ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", session)[:200] + ".jsonl"


def _encode(sequence_id: str, record: SequenceRecord) -> str:
    line: dict = {
        "sequence_id": sequence_id,
        "session": record.session,
        "prompt": list(record.prompt),
        "tokens": list(record.tokens),
        "logprobs": list(record.logprobs),
    }
    if record.routing is not None:
        routing = record.routing.to("cpu", torch.int16).numpy()
        line["routing"] = {"shape": list(routing.shape), "int16": base64.b64encode(routing.tobytes()).decode()}
    return json.dumps(line)


def _decode(line: str) -> tuple[str, SequenceRecord]:
    raw = json.loads(line)
    routing = None
    if raw.get("routing") is not None:
        data = np.frombuffer(base64.b64decode(raw["routing"]["int16"]), dtype=np.int16)
        routing = torch.from_numpy(data.reshape(raw["routing"]["shape"]).copy())
    record = SequenceRecord(
        session=raw["session"],
        prompt=tuple(raw["prompt"]),
        tokens=tuple(raw["tokens"]),
        logprobs=tuple(float(v) for v in raw["logprobs"]),
        routing=routing,
    )
    return raw["sequence_id"], record


class StabilityRecords:
    """Recorded sequences by ``sequence_id`` (module docstring).

    Args:
        directory: where the records persist (created if absent), or None to keep them in memory only.
        max_tokens: the memory bound (tokens of every held sequence together).
        ttl_s: how long a session's records live after its last use.
        clock: seconds since the epoch (tests pass a fake one).
    """

    def __init__(
        self,
        directory: Path | None,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory, self.max_tokens, self.ttl_s, self.clock = directory, max_tokens, ttl_s, clock
        self._records: OrderedDict[str, SequenceRecord] = OrderedDict()
        self._last_use: dict[str, float] = {}  # session -> last use
        self._tokens = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._restore()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def num_tokens(self) -> int:
        """Tokens held now (at most ``max_tokens``)."""
        return self._tokens

    def add(
        self,
        session: str,
        sequence_id: str,
        prompt: Sequence[int],
        tokens: Sequence[int],
        logprobs: Sequence[float],
        routing: torch.Tensor | None = None,
    ) -> None:
        """Record one sampled sequence (``logprobs`` rounded to float32, as the wire sends them) of ``session``."""
        if len(logprobs) != len(tokens):
            raise ValueError(f"{len(logprobs)} log-probs for {len(tokens)} sampled tokens")
        rounded = tuple(float(v) for v in np.asarray(logprobs, dtype=np.float32))
        record = SequenceRecord(session, tuple(int(t) for t in prompt), tuple(int(t) for t in tokens), rounded, routing)
        self._hold(sequence_id, record)
        self._touch(session)
        if self.directory is not None:
            with open(self.directory / _file_name(session), "a", encoding="utf-8") as f:
                f.write(_encode(sequence_id, record) + "\n")
        self.expire()

    def get(self, sequence_id: str) -> SequenceRecord | None:
        """The record of ``sequence_id`` (its session's last use is now), or None if never recorded, evicted or
        expired."""
        record = self._records.get(sequence_id)
        if record is None:
            return None
        if self.clock() - self._last_use.get(record.session, 0.0) > self.ttl_s:
            self.expire()
            return None
        self._records.move_to_end(sequence_id)
        self._touch(record.session)
        return record

    def expire(self) -> list[str]:
        """Drop every session unused for ``ttl_s`` (its records and its file); returns those sessions."""
        now = self.clock()
        gone = [s for s, t in self._last_use.items() if now - t > self.ttl_s]
        if not gone:
            return []
        dropped = set(gone)
        for sequence_id in [i for i, r in self._records.items() if r.session in dropped]:
            self._tokens -= self._records.pop(sequence_id).num_tokens
        for session in gone:
            del self._last_use[session]
            if self.directory is not None:
                (self.directory / _file_name(session)).unlink(missing_ok=True)
        return gone

    def _hold(self, sequence_id: str, record: SequenceRecord) -> None:
        old = self._records.pop(sequence_id, None)
        if old is not None:
            self._tokens -= old.num_tokens
        self._records[sequence_id] = record
        self._tokens += record.num_tokens
        while self._tokens > self.max_tokens and len(self._records) > 1:
            _, dropped = self._records.popitem(last=False)
            self._tokens -= dropped.num_tokens

    def _touch(self, session: str) -> None:
        now = self.clock()
        self._last_use[session] = now
        if self.directory is not None:
            path = self.directory / _file_name(session)
            if path.exists():
                os.utime(path, (now, now))

    def _restore(self) -> None:
        """Read the unexpired session files back (newest first, up to ``max_tokens``); rewrite or delete them."""
        assert self.directory is not None
        now = self.clock()
        files = sorted(self.directory.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)
        kept: list[tuple[Path, float, list[tuple[str, SequenceRecord]]]] = []
        budget = self.max_tokens
        for path in files:
            last_use = path.stat().st_mtime
            if now - last_use > self.ttl_s:
                path.unlink(missing_ok=True)
                continue
            try:
                entries = [_decode(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("stability records %s unreadable (%s); dropped", path, exc)
                path.unlink(missing_ok=True)
                continue
            chosen = []
            for sequence_id, record in reversed(entries):  # the newest records of the newest sessions first
                if record.num_tokens <= budget:
                    chosen.append((sequence_id, record))
                    budget -= record.num_tokens
            chosen.reverse()
            kept.append((path, last_use, chosen))
        for path, last_use, chosen in reversed(kept):  # oldest session first: it is evicted first
            if not chosen:
                path.unlink(missing_ok=True)
                continue
            path.write_text("".join(_encode(i, r) + "\n" for i, r in chosen), encoding="utf-8")
            os.utime(path, (last_use, last_use))
            for sequence_id, record in chosen:
                self._hold(sequence_id, record)
            self._last_use[chosen[0][1].session] = last_use
        if self._records:
            log.info("restored %d stability records (%d tokens) from %s", len(self), self._tokens, self.directory)
