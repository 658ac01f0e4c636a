"""Liveness (ringtune.parallel.liveness) with real processes: the OS probe, and waits of real gloo ranks.

- ``process_state`` of a real child: running, stopped (SIGSTOP), zombie (SIGKILLed, not reaped), gone;
- a rank stopped (SIGSTOP) for 5 s, five times the liveness timeout, is waited for on this host (its pid is
  there), and the value it then sends arrives; seen as another host's rank (heartbeat only), the same stop is
  a death after the timeout;
- a rank SIGKILLed while its peer waits for it is named dead within seconds, and :func:`dead_ranks` says so;
- broadcasts and gathers through the store deliver in order, and the read messages are deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from support.harness import RankPool

from ringtune.errors import RankFailedError
from ringtune.parallel import liveness
from ringtune.parallel.store_exchange import broadcast_from, exchange_objects, gather_objects_to

STOP_S = 5.0
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def pool2():
    pool = RankPool(2, timeout=120)
    yield pool
    pool.close()


def _wait_state(pid: int, want: str, start_time: int | None = None) -> str:
    deadline = time.monotonic() + 30
    state = liveness.process_state(pid, start_time)
    while state != want and time.monotonic() < deadline:
        time.sleep(0.02)
        state = liveness.process_state(pid, start_time)
    return state


def test_process_state_of_a_real_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = liveness._read_stat(child.pid)[1]
        assert liveness.process_state(child.pid, started) == "running"
        assert liveness.process_state(child.pid, started + 1) == "gone"  # the pid reused by another process
        os.kill(child.pid, signal.SIGSTOP)
        assert _wait_state(child.pid, "stopped", started) == "stopped"
        os.kill(child.pid, signal.SIGCONT)
        assert _wait_state(child.pid, "running", started) == "running"
        os.kill(child.pid, signal.SIGKILL)
        assert _wait_state(child.pid, "zombie", started) == "zombie"  # dead, not yet reaped: dead too
    finally:
        child.kill()
        child.wait()
    assert liveness.process_state(child.pid, started) == "gone"


def _world() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def _stopped_worker(ctx, remote: bool) -> dict:
    """Rank 1 stops itself for STOP_S (rank 0 wakes it), then sends its part; rank 0 waits for it meanwhile.
    ``remote``: rank 0 sees rank 1 as on another host (heartbeat only). (Rank 0 hosts the store: while it is
    stopped every store call of the others blocks, so the stopped rank is rank 1, as in a server.)"""
    liveness.configure(TIMEOUT_S)
    world = _world()
    pids = exchange_objects(os.getpid(), world)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT after STOP_S
        gather_objects_to("after the stop", world, dst=0)
        return {}
    seen: dict[str, str] = {}
    probe = threading.Timer(STOP_S / 2, lambda: seen.setdefault("state", liveness.process_state(pids[1])))
    wake = threading.Timer(STOP_S, os.kill, (pids[1], signal.SIGCONT))
    host_key = liveness._host_key
    if remote:
        liveness._host_key = lambda: "another host"
    probe.start(), wake.start()
    start = time.monotonic()
    try:
        return {"value": gather_objects_to(None, world, dst=0)[1], "waited": time.monotonic() - start, **seen}
    except RankFailedError as exc:
        return {"error": str(exc), "after": time.monotonic() - start, "dead": liveness.dead_ranks([1]), **seen}
    finally:
        wake.join()
        liveness._host_key = host_key
        liveness._state["dead"].clear()
        liveness.configure(liveness.DEFAULT_TIMEOUT_S)


def test_a_stopped_rank_on_this_host_is_waited_for(pool2):
    got = pool2.run(_stopped_worker, False)[0]
    assert got.get("state") == "stopped", got
    assert got.get("value") == "after the stop", got
    assert got["waited"] >= STOP_S - 0.5  # it really waited past the liveness timeout


def test_a_stopped_rank_on_another_host_dies_after_the_timeout(pool2):
    got = pool2.run(_stopped_worker, True)[0]
    assert "no heartbeat" in got.get("error", ""), got
    assert TIMEOUT_S <= got["after"] < STOP_S, got  # found by the heartbeat's timeout, before the stop ended
    assert list(got["dead"]) == [1]


def _killed_peer(ctx) -> dict | None:
    world = _world()
    exchange_objects(None, world)  # both joined
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        gather_objects_to("rank 0's part", world, dst=0)
    except RankFailedError as exc:
        return {"error": str(exc), "rank": exc.rank, "after": time.monotonic() - start, "dead": liveness.dead_ranks()}
    return {"error": None}


def test_a_killed_rank_is_named_within_seconds(pool2):
    got = pool2.run(_killed_peer, allow_dead=True)[0]
    assert got["rank"] == 1 and "its process ended" in got["error"], got
    assert got["after"] < 3 * liveness.POLL_S + 2, got  # a poll or two; the heartbeat timeout is 60 s
    assert list(got["dead"]) == [1]


def _round_trips(ctx) -> list:
    world, got = _world(), []
    for i in range(3):
        got.append(broadcast_from(f"message {i}" if ctx.rank == 0 else None, world, src=0))
        got.append(gather_objects_to((ctx.rank, i), world, dst=0))
    exchange_objects(None, world)  # every receiver has read every message
    broadcast_from("one more", world, src=0)  # the source deletes the messages read by all
    store, name = liveness.default_store(), world.group_name
    left = [seq for seq in range(3) if store.check([f"ringtune/b/{name}/{seq}"])]
    return [got, left]


def test_broadcast_and_gather_through_the_store(pool2):
    (got0, left0), (got1, _) = pool2.run(_round_trips)
    assert got0 == ["message 0", [(0, 0), (1, 0)], "message 1", [(0, 1), (1, 1)], "message 2", [(0, 2), (1, 2)]]
    assert got1 == ["message 0", None, "message 1", None, "message 2", None]
    assert left0 == []  # nothing piles up in the store
