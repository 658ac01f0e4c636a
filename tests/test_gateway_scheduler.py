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
