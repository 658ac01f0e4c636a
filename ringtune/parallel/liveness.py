"""Store-based exchange of small objects with liveness: agreement that a dead rank cannot stall.

A collective over gloo only notices a dead peer on the pairs that talk to it directly; the others wait
for their full timeout (a rank that is two hops from the dead one in a ring all-gather). Agreement therefore
goes through the job's key-value store (the c10d TCPStore every rank already shares):

- every process runs a daemon thread that bumps its heartbeat counter ``ringtune/alive/<rank>`` every
  :data:`HEARTBEAT_S` seconds over its own store connection;
- :func:`exchange_objects` writes this rank's object under a key of the exchange's sequence number, then
  waits for every other rank's key; while it waits it reads the missing ranks' heartbeats, and a rank whose
  counter has not moved for :data:`DEAD_AFTER_S` seconds is declared dead (:class:`RankFailedError`).

A rank that is alive but still computing keeps beating, so an exchange waits for it as long as it needs: no
timeout has to cover the longest request. A dead rank is found within ``DEAD_AFTER_S`` + one poll.

The same mechanism carries commands (:func:`publish_object` / :func:`receive_object`): an idle worker waits for
the next command without a timeout, for as long as the source rank is alive.
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ringtune.errors import RankFailedError

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats of a process."""

DEAD_AFTER_S = 10.0
"""A rank whose heartbeat has not moved for this long is dead."""

_POLL = timedelta(seconds=1.0)
_state: dict[str, Any] = {"thread": None, "sequence": {}}
_lock = threading.Lock()


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _alive_key(rank: int) -> str:
    return f"ringtune/alive/{rank}"


def _beat(store: dist.Store, rank: int) -> None:
    while True:
        try:
            store.add(_alive_key(rank), 1)
        except Exception:  # the store is gone (rank 0 exited): nothing left to tell
            return
        time.sleep(HEARTBEAT_S)


def start_heartbeat() -> None:
    """Start this process's heartbeat thread (once per process; idempotent)."""
    with _lock:
        thread = _state["thread"]
        if thread is not None and thread.is_alive():
            return
        thread = threading.Thread(target=_beat, args=(_store().clone(), dist.get_rank()), daemon=True)
        thread.start()
        _state["thread"] = thread


def wait_for_keys(store: dist.Store, keys: dict[int, str]) -> None:
    """Block until every ``keys[rank]`` exists in ``store``; RankFailedError if one of those ranks is dead.

    A rank is dead when its heartbeat counter has not moved for :data:`DEAD_AFTER_S` seconds; a rank that is
    alive is waited for as long as it takes.
    """
    start_heartbeat()
    seen = {r: (-1, time.monotonic()) for r in keys}
    missing = dict(keys)
    while missing:
        try:
            store.wait(list(missing.values()), _POLL)
            return
        except Exception:  # not all there yet: who is still alive?
            pass
        now = time.monotonic()
        for r in missing:
            count = store.add(_alive_key(r), 0)
            last, since = seen[r]
            if count != last:
                seen[r] = (count, now)
            elif now - since > DEAD_AFTER_S:
                raise RankFailedError(
                    f"rank {r} stopped responding (no heartbeat for {DEAD_AFTER_S:.0f} s): it died or its process "
                    "hung outside a collective",
                    rank=r,
                    error_type="RankDied",
                )
        missing = {r: k for r, k in missing.items() if not store.check([k])}


def next_sequence(name: str) -> int:
    """The next sequence number of the exchanges named ``name`` in this process (0, 1, 2, ...)."""
    seq = _state["sequence"].get(name, 0)
    _state["sequence"][name] = seq + 1
    return seq


def exchange_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's small picklable ``obj`` in group-rank order, on every rank of ``group``, via the store.

    Collective over ``group`` (every member calls it, in the same order as its other exchanges on the group).
    Raises RankFailedError naming a rank whose heartbeat stopped (dead) while it was waited for.
    """
    store = _store()
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    name = group.group_name
    seq = next_sequence(f"x/{name}")
    prefix = f"ringtune/x/{name}/{seq}/"
    store.set(prefix + str(me), pickle.dumps(obj))
    wait_for_keys(store, {r: prefix + str(r) for r in ranks if r != me})
    values = [pickle.loads(store.get(prefix + str(r))) for r in ranks]
    if seq >= 2:  # every rank has read exchange seq-2 before it wrote seq-1, which this rank has now read
        store.delete_key(f"ringtune/x/{name}/{seq - 2}/{me}")
    return values


def publish_object(obj: Any, channel: str) -> int:
    """Source side of a command channel: store ``obj`` as the channel's next message; its sequence number.

    The caller guarantees that every receiver has finished with message ``seq - 2`` (e.g. each message ends
    with an :func:`exchange_objects` among all ranks), which is then deleted.
    """
    store = _store()
    seq = next_sequence(f"c/{channel}")
    store.set(f"ringtune/c/{channel}/{seq}", pickle.dumps(obj))
    if seq >= 2:
        store.delete_key(f"ringtune/c/{channel}/{seq - 2}")
    return seq


def receive_object(channel: str, *, src: int) -> Any:
    """Receiver side: the channel's next message, waiting as long as global rank ``src`` is alive."""
    store = _store()
    seq = next_sequence(f"c/{channel}")
    key = f"ringtune/c/{channel}/{seq}"
    wait_for_keys(store, {src: key})
    return pickle.loads(store.get(key))
