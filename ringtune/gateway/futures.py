"""Futures (request_id -> outcome, long-polled) and the per-run ``seq_id`` gate.

Both live on the gateway's event loop thread only (no locks); the worker thread hands outcomes back
through the loop (``loop.call_soon_threadsafe`` / asyncio futures).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ringtune.errors import UserInputError


@dataclass(frozen=True)
class Outcome:
    """What ``retrieve_future`` answers once an op is done: a JSON object, protobuf bytes, or an error object."""

    kind: Literal["json", "proto", "error"]
    body: dict[str, Any] | bytes

    @staticmethod
    def error(message: str, category: Literal["user", "server"]) -> Outcome:
        """``{"error": message, "category": category}`` (the SDK raises RequestFailedError)."""
        return Outcome("error", {"error": message, "category": category})


@dataclass
class _Entry:
    op: str
    created: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    done_at: float | None = None
    retrieved_at: float | None = None


class FutureStore:
    """request_id -> pending or finished op; results kept until retrieved (then ``retrieved_keep_s`` more, for a
    re-poll after a dropped connection), unretrieved ones at most ``max_age_s``, at most ``max_done`` finished
    ones (oldest dropped first). Pending futures are never dropped."""

    def __init__(
        self,
        *,
        max_done: int = 10_000,
        max_age_s: float = 3600.0,
        retrieved_keep_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_done, self.max_age_s, self.retrieved_keep_s = max_done, max_age_s, retrieved_keep_s
        self.clock = clock
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def create(self, op: str) -> str:
        """A new pending future for ``op`` (e.g. ``forward_backward``); returns its request_id."""
        request_id = f"{op}-{uuid.uuid4().hex}"
        self._entries[request_id] = _Entry(op=op, created=self.clock())
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Finish a future (ignored if it was already finished or dropped) and wake its pollers."""
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome, entry.done_at = outcome, self.clock()
        entry.event.set()

    def known(self, request_id: str) -> bool:
        """True while the future exists (pending, or finished and not yet dropped)."""
        return request_id in self._entries

    def pending(self, request_id: str) -> bool:
        """True while the future exists and has no outcome."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.outcome is None

    async def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome, waiting up to ``timeout_s``; None if still pending then. KeyError for an unknown id."""
        entry = self._entries[request_id]
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.event.wait(), timeout=timeout_s)
            except TimeoutError:
                return None
        entry.retrieved_at = entry.retrieved_at or self.clock()
        return entry.outcome

    def finished(self, op: str, since: float) -> list[tuple[float, Outcome]]:
        """``(done_at, outcome)`` of the finished futures of ``op`` created at or after ``since`` (clock time),
        in the order they finished (for tools and tests that check what was served when)."""
        done = [
            (e.done_at, e.outcome)
            for e in list(self._entries.values())
            if e.op == op and e.created >= since and e.outcome is not None and e.done_at is not None
        ]
        return sorted(done, key=lambda pair: pair[0])

    def unsettled(self, since: float) -> int:
        """Futures still pending, plus those finished at or after ``since`` (clock time) and not yet retrieved."""
        return sum(
            e.outcome is None or (e.retrieved_at is None and (e.done_at or 0.0) >= since)
            for e in list(self._entries.values())
        )

    def prune(self) -> int:
        """Drop expired finished futures (see the class docstring); returns how many were dropped."""
        now = self.clock()
        drop = [
            rid
            for rid, e in self._entries.items()
            if e.done_at is not None
            and (
                (e.retrieved_at is not None and now - e.retrieved_at > self.retrieved_keep_s)
                or now - e.done_at > self.max_age_s
            )
        ]
        done = [(e.retrieved_at is None, e.done_at, rid) for rid, e in self._entries.items() if e.done_at is not None]
        excess = len(done) - len(drop) - self.max_done
        if excess > 0:
            dropped = set(drop)
            drop += [rid for *_, rid in sorted(done) if rid not in dropped][:excess]
        for rid in drop:
            self._entries.pop(rid, None)
        return len(drop)


class SeqGate:
    """Runs one training run's ops in ``seq_id`` order (1, 2, 3, ...).

    An op that arrives early is held until every smaller ``seq_id`` has started; a resubmit of a known
    ``seq_id`` gets the original request_id; a gap that stays open ``gap_timeout_s`` while later ops wait
    is skipped (its submit was rejected before it got here, so it will never come), and a late arrival
    of a skipped or already-passed ``seq_id`` is refused.
    """

    KEEP_KNOWN = 4096
    """How many past seq_ids remember their request_id (for resubmits)."""

    MAX_AHEAD = 100_000
    """How far beyond the next expected seq_id an op may arrive (an SDK client is as far ahead as it has ops in
    flight); a larger ``seq_id`` is refused, so a gap never spans more than this many skipped ids."""

    def __init__(self, first: int | None = 1) -> None:
        """``first``: the first seq_id to run; None: whichever arrives first (a run restored after a restart of
        the server, whose client goes on numbering where it was)."""
        self.next_seq = first
        self._held: dict[int, tuple[str, Callable[[], None]]] = {}
        self._known: dict[int, str] = {}
        self._blocked_since: float | None = None

    def request_for(self, seq_id: int) -> str | None:
        """The request_id of an op already submitted with ``seq_id``, if any."""
        return self._known.get(seq_id)

    def add(self, seq_id: int, request_id: str, start: Callable[[], None], now: float) -> None:
        """Queue ``start`` (which dispatches the op) to run when ``seq_id``'s turn comes; may run it now.

        Raises UserInputError when ``seq_id`` is below the next expected one and unknown (skipped or passed).
        """
        if self.next_seq is None:
            self.next_seq = seq_id
        if seq_id < self.next_seq:
            raise UserInputError(
                f"seq_id={seq_id} comes too late: this model already runs seq_id {self.next_seq} "
                "(it was skipped after waiting, or never submitted)"
            )
        if seq_id > self.next_seq + self.MAX_AHEAD:
            raise UserInputError(
                f"seq_id={seq_id} is more than {self.MAX_AHEAD} ahead of this model's next seq_id {self.next_seq}"
            )
        self._known[seq_id] = request_id
        self._held[seq_id] = (request_id, start)
        if self._blocked_since is None:
            self._blocked_since = now
        self._release(now)

    def _release(self, now: float) -> None:
        while self.next_seq in self._held:
            _, start = self._held.pop(self.next_seq)
            self.next_seq += 1
            start()
        self._blocked_since = now if self._held else None
        for old in [s for s in self._known if s < self.next_seq - self.KEEP_KNOWN]:
            del self._known[old]

    def skip_stale_gap(self, now: float, gap_timeout_s: float) -> range:
        """If later ops have waited ``gap_timeout_s`` for a missing seq_id, skip to the smallest held one;
        the skipped seq_ids (empty if none)."""
        if not self._held or self._blocked_since is None or now - self._blocked_since < gap_timeout_s:
            return range(0)
        first = min(self._held)
        skipped = range(self.next_seq, first)
        self.next_seq = first
        self._release(now)
        return skipped

    def cancel(self) -> list[str]:
        """Drop every held op (the run is gone); returns their request_ids."""
        ids = [rid for rid, _ in self._held.values()]
        self._held.clear()
        self._blocked_since = None
        return ids
