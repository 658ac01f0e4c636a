"""The gateway's backend thread, fair across clients: one worker thread, one FIFO queue per key, keys served
round-robin.

Every backend call runs on one thread (the backend and the worker ranks take one command at a time). With a
single FIFO queue, a client that queues a burst of ops (an SDK pipelining many ``forward_backward`` calls,
or a loop of ``asample`` without waiting) holds every other client back for the whole burst. Here each job is
queued under a key (the gateway uses the training run's id, ``"sampling"`` for the batched sampling drain and
``"default"`` for the rest) and the worker takes one job from each waiting key in turn: another client's op
waits for at most one op of each other busy key, never for a whole burst. Jobs of one key keep their order,
which is all the gateway's ordering needs (a run's ops are dispatched in ``seq_id`` order under its key).

A job that is running is never interrupted. A long generation is cut into turns by the gateway instead
(:mod:`ringtune.gateway.sampling`: each turn decodes for ``sample_slice_s`` and queues the next under its own
key), so it delays the others by about one slice; one long forward still delays them by its own duration
(docs/operations.md, "Load").
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

DEFAULT_KEY = "default"


class FairExecutor(Executor):
    """An :class:`~concurrent.futures.Executor` with one worker thread serving per-key FIFO queues round-robin.

    ``submit(fn)`` queues under :data:`DEFAULT_KEY` (so ``loop.run_in_executor`` works); ``submit_for(key, fn)``
    under ``key``. ``shutdown(wait, cancel_futures)`` behaves like ``ThreadPoolExecutor``'s: queued jobs run
    (or are cancelled with ``cancel_futures``), new ones raise RuntimeError.
    """

    def __init__(self, thread_name: str = "ringtune-backend") -> None:
        self._queues: OrderedDict[str, deque[tuple[Future, Callable[..., Any], tuple, dict]]] = OrderedDict()
        self._cv = threading.Condition()
        self._shutdown = False
        self._thread = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return self.submit_for(DEFAULT_KEY, fn, *args, **kwargs)

    def submit_for(self, key: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)`` behind the earlier jobs of ``key``; its Future."""
        future: Future = Future()
        with self._cv:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queues.setdefault(key, deque()).append((future, fn, args, kwargs))
            self._cv.notify()
        return future

    def queued(self) -> dict[str, int]:
        """Jobs waiting per key (not the running one)."""
        with self._cv:
            return {key: len(queue) for key, queue in self._queues.items()}

    def _take(self) -> tuple[Future, Callable[..., Any], tuple, dict]:
        """The first job of the key whose turn it is; that key goes to the back of the rotation (with _cv)."""
        key, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        del self._queues[key]
        if queue:
            self._queues[key] = queue
        return job

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queues and not self._shutdown:
                    self._cv.wait()
                if not self._queues:
                    return
                future, fn, args, kwargs = self._take()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._shutdown = True
            if cancel_futures:
                for queue in self._queues.values():
                    for future, _, _, _ in queue:
                        future.cancel()
                self._queues.clear()
            self._cv.notify_all()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
