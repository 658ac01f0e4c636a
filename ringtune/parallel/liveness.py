"""Liveness of the ranks of a job: can a rank still make progress, asked of the best signal there is.

A rank that is slow (starved of CPU, stopped by SIGSTOP, holding the GIL in a long kernel, writing a large
checkpoint) must never be taken for dead; a rank that died (SIGKILL, OOM) must be found quickly. Signals,
best first:

1. **The OS, on the same host.** Every rank publishes its :class:`RankIdentity` (host key, pid, process start
   time) in the job's store when it joins (:func:`join`). A rank on this host is alive exactly while its
   process exists and is not a zombie (``os.kill(pid, 0)`` and ``/proc/<pid>/stat``; a stopped ``T`` process
   is alive); the start time guards against a reused pid. No timing is involved: a rank stopped for an hour is
   alive, a killed one is dead at the next poll.
2. **The store.** The store lives in rank 0's process: when it dies, every store call of the others fails
   (callers treat that as "rank 0 is gone").
3. **A heartbeat, last resort**, for a rank on another host: every process bumps ``ringtune/alive/<rank>``
   every :data:`HEARTBEAT_S` seconds from a daemon thread started at :func:`join`; a remote rank whose counter
   has not moved for the liveness timeout (:func:`configure`, ``serve --liveness-timeout``, default
   :data:`DEFAULT_TIMEOUT_S`) is dead.

API (for waits, for healthz and for a supervisor):

- :func:`join` (every process, when it joins the world: :func:`ringtune.parallel.launch.init_process_group`),
  :func:`leave` (a supervisor tearing a world down), :func:`configure` (the timeout);
- :func:`process_state` (one pid), :func:`rank_status` (one rank), :func:`dead_ranks` (which ranks are dead
  right now, with the reason), :func:`wait_for_keys` (a store wait that raises ``RankFailedError`` naming a
  dead rank instead of timing out).

Exchanges of objects built on it are in :mod:`ringtune.parallel.store_exchange`.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ringtune.errors import RankFailedError

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats of a process."""

DEFAULT_TIMEOUT_S = 60.0
"""Liveness timeout: a rank on another host whose heartbeat has not moved this long is dead (never used for a
rank whose process this host can see)."""

POLL_S = 1.0
"""How often a waiting rank re-checks whether the ranks it waits for are alive."""

STALL_S = 5.0
"""A store call that takes longer than this means the store stalled: heartbeat silence is counted from its end."""

MAX_SLEEP_S = 0.05
"""Longest pause between two looks for an awaited key (an idle worker looks 20 times a second)."""

_lock = threading.Lock()
_state: dict[str, Any] = {
    "timeout_s": DEFAULT_TIMEOUT_S,
    "thread": None,
    "generation": 0,  # bumped by join() and leave(): an older heartbeat thread stops
    "store": None,  # the default store this process joined
    "probe": None,  # a store connection of liveness's own (used under _lock, from any thread)
    "identities": {},  # rank -> RankIdentity, once published
    "beats": {},  # rank -> (last counter seen, monotonic time it was first seen)
    "dead": {},  # rank -> reason; a dead rank stays dead
}


@dataclass(frozen=True)
class RankIdentity:
    """Where a rank's process runs: ``host`` (hostname + boot id + pid namespace: two ranks with the same key
    see the same pids), ``pid``, ``start_time`` (``/proc/<pid>/stat`` field 22, clock ticks since boot; None
    where there is no /proc)."""

    host: str
    pid: int
    start_time: int | None


def _read_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) from ``/proc/<pid>/stat``; None if unreadable (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name (field 2) may hold spaces and ')'
    return fields[0], int(fields[19])


def _host_key() -> str:
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else open(path).read().strip())
        except OSError:
            parts.append("?")
    return "/".join(parts)


def my_identity() -> RankIdentity:
    """This process's :class:`RankIdentity`."""
    stat = _read_stat(os.getpid())
    return RankIdentity(_host_key(), os.getpid(), None if stat is None else stat[1])


def process_state(pid: int, start_time: int | None = None) -> str:
    """What the OS says of process ``pid`` on this host: ``"running"``, ``"stopped"`` (SIGSTOP, traced),
    ``"zombie"`` (exited, not reaped), ``"gone"`` (no such process, or the pid now belongs to a process started
    at another time than ``start_time``). Alive = running or stopped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:  # exists, belongs to another user
        pass
    stat = _read_stat(pid)
    if stat is None:  # no /proc: os.kill said it exists
        return "running"
    letter, started = stat
    if start_time is not None and started != start_time:
        return "gone"
    if letter in "ZX":
        return "zombie"
    return "stopped" if letter in "Tt" else "running"


def configure(timeout_s: float) -> None:
    """Set this process's liveness timeout (seconds > 0; see :data:`DEFAULT_TIMEOUT_S`)."""
    if not timeout_s > 0:
        raise ValueError(f"liveness timeout {timeout_s!r} must be > 0 seconds")
    _state["timeout_s"] = float(timeout_s)


def default_store() -> dist.Store:
    """The job's key-value store (the default group's c10d store)."""
    return dist.distributed_c10d._get_default_store()


def put_bytes(store: dist.Store, key: str, value: bytes) -> None:
    """``store.set(key, value)`` with bytes (pickles): the binding takes bytes, as ``get`` returns them; torch's
    type stub says ``str``."""
    store.set(key, value)  # type: ignore[arg-type]


def clone_store(store: dist.Store) -> dist.Store:
    """A new connection to ``store`` (``Store.clone``: a thread's own client; absent from torch's type stub)."""
    return store.clone()  # type: ignore[attr-defined]


def _alive_key(rank: int) -> str:
    return f"ringtune/alive/{rank}"


def _who_key(rank: int) -> str:
    return f"ringtune/who/{rank}"


def _beat(store: dist.Store, rank: int, generation: int) -> None:
    failing_since = None
    while _state["generation"] == generation:  # until leave() or the next join() of another world
        try:
            store.add(_alive_key(rank), 1)
            failing_since = None
        except Exception:  # a blip, or the store is gone (rank 0 exited): give up once it lasts
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > _state["timeout_s"]:
                return
        time.sleep(HEARTBEAT_S)


def join() -> None:
    """Publish this rank's identity and start its heartbeat (every process, right after it joins the world;
    idempotent). Later calls of the functions below also join, for callers that did not."""
    with _lock:
        store, thread = default_store(), _state["thread"]
        if thread is not None and thread.is_alive() and _state["store"] is store:
            return
        rank = dist.get_rank()
        put_bytes(store, _who_key(rank), pickle.dumps(my_identity()))
        _state["generation"] += 1
        _state.update(store=store, probe=clone_store(store), identities={}, beats={}, dead={})
        beat_args = (clone_store(store), rank, _state["generation"])
        thread = threading.Thread(target=_beat, args=beat_args, daemon=True, name="ringtune-heartbeat")
        thread.start()
        _state["thread"] = thread


def leave() -> None:
    """Forget this process's part in its world (after its default process group is destroyed, before it joins a
    new one): the heartbeat thread stops, identities, heartbeats and dead ranks are forgotten."""
    with _lock:
        _state["generation"] += 1
        _state.update(thread=None, store=None, probe=None, identities={}, beats={}, dead={})


def _identity(probe: dist.Store, rank: int) -> RankIdentity | None:
    known = _state["identities"].get(rank)
    if known is None and probe.check([_who_key(rank)]):
        known = _state["identities"][rank] = pickle.loads(probe.get(_who_key(rank)))
    return known


def _status(rank: int) -> tuple[bool, str]:
    """(alive, how it was told) of global rank ``rank``; call under ``_lock``."""
    if rank in _state["dead"]:
        return False, _state["dead"][rank]
    probe = _state["probe"]
    who = _identity(probe, rank)
    if who is not None and who.host == _host_key():
        state = process_state(who.pid, who.start_time)
        if state in ("running", "stopped"):
            return True, f"process {who.pid} is {state}"
        reason = f"rank {rank} (pid {who.pid}) {'exited' if state == 'zombie' else 'is gone'}: its process ended"
    else:
        asked = time.monotonic()
        count, now = probe.add(_alive_key(rank), 0), time.monotonic()
        last, since = _state["beats"].get(rank, (None, now))
        if now - asked > STALL_S:  # the store itself stalled (rank 0 stopped): nobody could beat meanwhile
            since = now
        if count != last or since == now:
            _state["beats"][rank] = (count, now)
            return True, "heartbeat moved"
        silent = now - since
        if silent <= _state["timeout_s"]:
            return True, f"heartbeat still for {silent:.0f} s"
        where = f"on host {who.host.split('/')[0]}, pid {who.pid}" if who else "not yet joined"
        reason = (
            f"rank {rank} ({where}) sent no heartbeat for {silent:.0f} s (liveness timeout "
            f"{_state['timeout_s']:.0f} s): it died or its host is unreachable"
        )
    _state["dead"][rank] = reason
    return False, reason


def rank_status(rank: int) -> tuple[bool, str]:
    """``(alive, how it was told)`` of global rank ``rank`` of the default group (see the module docstring)."""
    join()
    with _lock:
        return _status(rank)


def dead_ranks(ranks: list[int] | None = None) -> dict[int, str]:
    """``{rank: reason}`` of the ranks among ``ranks`` (default: every rank of the world but this one) that are
    dead right now. Safe from any thread; a dead rank stays dead."""
    join()
    if ranks is None:
        ranks = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
    with _lock:
        return {r: reason for r in ranks for alive, reason in [_status(r)] if not alive}


def wait_for_keys(store: dist.Store, keys: dict[int, str]) -> None:
    """Block until every ``keys[rank]`` exists in ``store``; RankFailedError (``error_type="RankDied"``) as soon
    as one of those ranks is dead. A rank that is alive is waited for as long as it takes.

    Polls with ``store.check`` (every 1 ms at first, backing off to :data:`MAX_SLEEP_S`), never with a timed
    ``store.wait``: a c10d TCPStore client whose wait timed out answers its next wait late, and the default
    store is shared with everything else of the process.
    """
    join()
    missing = list(keys.values())
    delay, checked = 0.001, time.monotonic()
    while not store.check(missing):
        time.sleep(delay)
        delay = min(2 * delay, MAX_SLEEP_S)
        if time.monotonic() - checked >= POLL_S:
            for r, key in keys.items():
                alive, reason = rank_status(r)
                if not alive and not store.check([key]):
                    raise RankFailedError(reason, rank=r, error_type="RankDied")
            checked = time.monotonic()
