"""Small objects between ranks through the job's key-value store, each wait bounded by liveness, not by a timeout.

A gloo collective only notices a dead peer on the pairs that talk to it directly, and a rank that waits in one
while another rank computes alone (rank 0 decoding a long generation, writing a checkpoint) breaks the mesh when
the collective's timeout runs out. Everything a rank may wait in for another rank's work therefore goes through
the c10d store every rank already shares, and every wait is :func:`ringtune.parallel.liveness.wait_for_keys`:
it lasts as long as the awaited rank is alive (hours if need be) and raises ``RankFailedError`` naming it as
soon as it is dead.

- :func:`exchange_objects`: every rank's object on every rank (verdicts, small per-rank facts);
- :func:`gather_objects_to`: every rank's object on one rank (results); the others do not wait;
- :func:`broadcast_from`: one rank's object on every rank (a file write's result);
- :func:`publish_object` / :func:`receive_object`: a command channel from one rank to the others.

Each is collective over its group (every member calls it, in the same order as its other calls on the group):
keys carry a per-process sequence number per group and kind, so they line up without any other agreement.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from ringtune.parallel.liveness import default_store, put_bytes, wait_for_keys

_state: dict[str, Any] = {"store": None, "sequence": {}, "unread": {}}
"""Per world (reset when the default store changes, e.g. a supervisor's new world): the sequence numbers, and
per broadcast prefix the sequence numbers whose keys are not yet deleted."""


def _of_this_world() -> dict[str, Any]:
    store = default_store()
    if _state["store"] is not store:
        _state.update(store=store, sequence={}, unread={})
    return _state


def reset() -> None:
    """Forget the sequence numbers of this process's world (a supervisor tearing it down; a new default store
    also starts them over)."""
    _state.update(store=None, sequence={}, unread={})


def next_sequence(name: str) -> int:
    """The next sequence number of the calls named ``name`` in this process and world (0, 1, 2, ...)."""
    sequence = _of_this_world()["sequence"]
    seq = sequence.get(name, 0)
    sequence[name] = seq + 1
    return seq


def exchange_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's small picklable ``obj`` in group-rank order, on every rank of ``group``.

    Raises RankFailedError naming a rank that died while it was waited for.
    """
    store = default_store()
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    name = group.group_name
    seq = next_sequence(f"x/{name}")
    prefix = f"ringtune/x/{name}/{seq}/"
    put_bytes(store, prefix + str(me), pickle.dumps(obj))
    wait_for_keys(store, {r: prefix + str(r) for r in ranks if r != me})
    values = [pickle.loads(store.get(prefix + str(r))) for r in ranks]
    if seq >= 2:  # every rank has read exchange seq-2 before it wrote seq-1, which this rank has now read
        store.delete_key(f"ringtune/x/{name}/{seq - 2}/{me}")
    return values


def gather_objects_to(obj: Any, group: dist.ProcessGroup, *, dst: int = 0) -> list[Any] | None:
    """Every rank's picklable ``obj`` in group-rank order on group rank ``dst``; None on the others, which
    return at once (they wait for ``dst`` later, in their next exchange). ``dst`` deletes the keys it read."""
    store = default_store()
    ranks = dist.get_process_group_ranks(group)
    me, root = dist.get_rank(), dist.get_global_rank(group, dst)
    seq = next_sequence(f"g/{group.group_name}")
    prefix = f"ringtune/g/{group.group_name}/{seq}/"
    if me != root:
        put_bytes(store, prefix + str(me), pickle.dumps(obj))
        return None
    others = {r: prefix + str(r) for r in ranks if r != me}
    wait_for_keys(store, others)
    values = [obj if r == me else pickle.loads(store.get(others[r])) for r in ranks]
    for key in others.values():
        store.delete_key(key)
    return values


def broadcast_from(obj: Any, group: dist.ProcessGroup, *, src: int = 0) -> Any:
    """Group rank ``src``'s picklable ``obj`` on every rank of ``group`` (the others pass anything).

    Each receiver counts itself in once it has read; ``src`` deletes a message every receiver has read at its
    next broadcast on the group.
    """
    store = default_store()
    ranks = dist.get_process_group_ranks(group)
    me, root = dist.get_rank(), dist.get_global_rank(group, src)
    base = f"ringtune/b/{group.group_name}/"
    seq = next_sequence(f"b/{group.group_name}")
    key = f"{base}{seq}"
    if me != root:
        wait_for_keys(store, {root: key})
        value = pickle.loads(store.get(key))
        store.add(key + "/read", 1)
        return value
    unread = _of_this_world()["unread"].setdefault(base, [])
    for old in list(unread):
        if store.add(f"{base}{old}/read", 0) >= len(ranks) - 1:
            store.delete_key(f"{base}{old}")
            store.delete_key(f"{base}{old}/read")
            unread.remove(old)
    put_bytes(store, key, pickle.dumps(obj))
    unread.append(seq)
    return obj


def publish_object(obj: Any, channel: str) -> int:
    """Source side of a command channel: store ``obj`` as the channel's next message; its sequence number.

    The caller guarantees that every receiver has finished with message ``seq - 2`` (e.g. each message ends
    with an :func:`exchange_objects` among all ranks), which is then deleted.
    """
    store = default_store()
    seq = next_sequence(f"c/{channel}")
    put_bytes(store, f"ringtune/c/{channel}/{seq}", pickle.dumps(obj))
    if seq >= 2:
        store.delete_key(f"ringtune/c/{channel}/{seq - 2}")
    return seq


def receive_object(channel: str, *, src: int) -> Any:
    """Receiver side: the channel's next message, waiting as long as global rank ``src`` is alive."""
    store = default_store()
    seq = next_sequence(f"c/{channel}")
    key = f"ringtune/c/{channel}/{seq}"
    wait_for_keys(store, {src: key})
    return pickle.loads(store.get(key))
