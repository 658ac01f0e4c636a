"""FairExecutor: one worker thread, FIFO per key, keys served round-robin; ThreadPoolExecutor's shutdown rules."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest

from ringtune.gateway.scheduler import FairExecutor


def test_a_burst_of_one_key_does_not_hold_back_another():
    executor = FairExecutor("test-fair")
    gate, started, order = threading.Event(), threading.Event(), []
    executor.submit_for("blocker", lambda: (started.set(), gate.wait()))  # the worker is busy while queues fill
    assert started.wait(10)
    futures = [executor.submit_for("burst", order.append, f"burst{i}") for i in range(5)]
    futures += [executor.submit_for("other", order.append, f"other{i}") for i in range(2)]
    futures.append(executor.submit(order.append, "default0"))
    gate.set()
    for future in futures:
        future.result(timeout=10)
    # one job of each waiting key in turn; each key's own jobs in order
    assert order == ["burst0", "other0", "default0", "burst1", "other1", "burst2", "burst3", "burst4"]
    executor.shutdown()


def test_errors_shutdown_and_cancel_like_a_thread_pool():
    executor = FairExecutor("test-fair")
    with pytest.raises(ZeroDivisionError):
        executor.submit(lambda: 1 / 0).result(timeout=10)
    gate, started = threading.Event(), threading.Event()
    running = executor.submit(lambda: (started.set(), gate.wait())[1])
    assert started.wait(10)  # on a busy machine the worker may not have taken it yet: it would be cancelled
    queued = executor.submit_for("k", lambda: "never")
    threading.Timer(0.2, gate.set).start()
    executor.shutdown(wait=True, cancel_futures=True)
    assert running.result(timeout=1) is True and queued.cancelled()
    with pytest.raises(CancelledError):
        queued.result()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(lambda: None)


def test_run_in_executor_uses_the_default_key():
    executor = FairExecutor("test-fair")

    async def main() -> str:
        return await asyncio.get_running_loop().run_in_executor(executor, lambda: threading.current_thread().name)

    assert asyncio.run(main()) == "test-fair"
    executor.shutdown()


def test_joinable_jobs_run_together_only_from_queue_heads():
    executor = FairExecutor("test-fair", max_join=8)
    gate, started, calls = threading.Event(), threading.Event(), []
    executor.submit_for("blocker", lambda: (started.set(), gate.wait()))
    assert started.wait(10)

    def runner(items: list[str]) -> list[str]:
        calls.append(list(items))
        return [f"done-{item}" for item in items]

    futures = [
        executor.submit_joinable("A", "X", "a1", runner),
        executor.submit_joinable("A", "X", "a2", runner),  # behind a1: never joins a1's pass
        executor.submit_for("B", calls.append, "b1"),
        executor.submit_joinable("B", "X", "b2", runner),  # behind b1: joins only once b1 ran
        executor.submit_joinable("C", "X", "c1", runner),
        executor.submit_joinable("D", "Y", "d1", runner),  # another kind: alone
    ]
    gate.set()
    assert [f.result(timeout=10) for f in futures] == ["done-a1", "done-a2", None, "done-b2", "done-c1", "done-d1"]
    assert calls == [["a1", "c1"], "b1", ["d1"], ["a2", "b2"]]
    executor.shutdown()


def test_joined_jobs_respect_max_join_and_share_an_error():
    executor = FairExecutor("test-fair", max_join=2)
    gate, started, calls = threading.Event(), threading.Event(), []
    executor.submit_for("blocker", lambda: (started.set(), gate.wait()))
    assert started.wait(10)

    def runner(items: list[int]) -> list[int]:
        calls.append(list(items))
        if 9 in items:
            raise ValueError("boom")
        return items

    futures = [executor.submit_joinable(f"k{i}", "X", i, runner) for i in range(3)]
    failing = [executor.submit_joinable("k9", "Z", 9, runner), executor.submit_joinable("k8", "Z", 8, runner)]
    gate.set()
    assert [f.result(timeout=10) for f in futures] == [0, 1, 2]
    for future in failing:
        with pytest.raises(ValueError, match="boom"):
            future.result(timeout=10)
    assert calls == [[0, 1], [2], [9, 8]]  # k2 is next in the rotation
    with pytest.raises(ValueError, match="max_join"):
        FairExecutor("test-fair", max_join=0)
    executor.shutdown()
