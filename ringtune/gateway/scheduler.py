"""The gateway's backend thread, fair across clients: one worker thread, one FIFO queue per key, keys served
round-robin.

Every backend call runs on one thread (the backend and the worker ranks take one command at a time). With a
single FIFO queue, a client that queues a burst of ops (an SDK pipelining many ``forward_backward`` calls,
or a loop of ``asample`` without waiting) holds every other client back for the whole burst. Here each job is
queued under a key (the gateway uses the training run's id, ``"sampling"`` for the batched sampling drain and
``"default"`` for the rest) and the worker takes one job from each waiting key in turn: another client's op
waits for at most one op of each other busy key, never for a whole burst. Jobs of one key keep their order,
which is all the gateway's ordering needs (a run's ops are dispatched in ``seq_id`` order under its key).

Joinable jobs (:meth:`FairExecutor.submit_joinable`): a job with a ``kind`` may run together with the jobs of
the same kind at the head of other keys' queues (never behind another job of its key, so each key's order
holds): when one comes up, the worker takes it and up to ``max_join − 1`` such heads, in rotation order, and
calls its runner once with all their items. The gateway joins LoRA runs' forward passes this way
(:mod:`ringtune.gateway.passes`).

A job that is running is never interrupted. A long generation is cut into turns by the gateway instead
(:mod:`ringtune.gateway.sampling`: each turn decodes for ``sample_slice_s`` and queues the next under its own
key), so it delays the others by about one slice; one long forward still delays them by its own duration
(docs/operations.md, "Load").
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

DEFAULT_KEY = "default"


@dataclass
class _Job:
    future: Future
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    kind: Hashable | None = None  # joinable: ``fn(items)`` runs every joined job's ``args[0]``


class FairExecutor(Executor):
    """An :class:`~concurrent.futures.Executor` with one worker thread serving per-key FIFO queues round-robin.

    ``submit(fn)`` queues under :data:`DEFAULT_KEY` (so ``loop.run_in_executor`` works); ``submit_for(key, fn)``
    under ``key``. ``shutdown(wait, cancel_futures)`` behaves like ``ThreadPoolExecutor``'s: queued jobs run
    (or are cancelled with ``cancel_futures``), new ones raise RuntimeError.
    """

    def __init__(self, thread_name: str = "ringtune-backend", *, max_join: int = 1) -> None:
        """``max_join``: the most joinable jobs run together (1: each alone)."""
        if max_join < 1:
            raise ValueError(f"max_join={max_join} must be >= 1")
        self.max_join = max_join
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._cv = threading.Condition()
        self._shutdown = False
        self._thread = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)`` under the default key; its Future (RuntimeError after :meth:`shutdown`)."""
        return self.submit_for(DEFAULT_KEY, fn, *args, **kwargs)

    def submit_for(self, key: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)`` behind the earlier jobs of ``key``; its Future."""
        return self._queue(key, _Job(Future(), fn, args, kwargs))

    def submit_joinable(self, key: str, kind: Hashable, item: Any, runner: Callable[[list[Any]], list[Any]]) -> Future:
        """Queue ``item`` behind the earlier jobs of ``key``; when it runs, jobs of the same ``kind`` at the head
        of other keys may join it: ``runner([item, ...])`` (the runner of the job whose turn it is) returns one
        result per item, each set on its job's Future (an exception it raises is set on all of them)."""
        return self._queue(key, _Job(Future(), runner, (item,), {}, kind))

    def _queue(self, key: str, job: _Job) -> Future:
        with self._cv:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queues.setdefault(key, deque()).append(job)
            self._cv.notify()
        return job.future

    def queued(self) -> dict[str, int]:
        """Jobs waiting per key (not the running one)."""
        with self._cv:
            return {key: len(queue) for key, queue in self._queues.items()}

    def _pop(self, key: str) -> _Job:
        """The first job of ``key``; the key goes to the back of the rotation (with _cv)."""
        queue = self._queues.pop(key)
        job = queue.popleft()
        if queue:
            self._queues[key] = queue
        return job

    def _take(self) -> list[_Job]:
        """The first job of the key whose turn it is, and the joinable heads of its kind (with _cv)."""
        first = next(iter(self._queues))
        jobs = [self._pop(first)]
        kind = jobs[0].kind
        if kind is not None:  # one job per key: the first key's next job waits for its own turn
            heads = [k for k, q in self._queues.items() if k != first and q[0].kind == kind]
            for key in heads[: self.max_join - 1]:
                jobs.append(self._pop(key))
        return jobs

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queues and not self._shutdown:
                    self._cv.wait()
                if not self._queues:
                    return
                jobs = [job for job in self._take() if job.future.set_running_or_notify_cancel()]
            if not jobs:
                continue
            try:
                if jobs[0].kind is None:
                    results = [jobs[0].fn(*jobs[0].args, **jobs[0].kwargs)]
                else:
                    results = jobs[0].fn([job.args[0] for job in jobs])
                    if len(results) != len(jobs):
                        raise RuntimeError(f"a joined runner returned {len(results)} results for {len(jobs)} jobs")
            except BaseException as exc:
                for job in jobs:
                    job.future.set_exception(exc)
            else:
                for job, result in zip(jobs, results, strict=True):
                    job.future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Accept no more jobs; with ``cancel_futures`` cancel the queued ones; with ``wait`` join the thread once
        the job running now (and, without ``cancel_futures``, every queued one) has finished."""
        with self._cv:
            self._shutdown = True
            if cancel_futures:
                for queue in self._queues.values():
                    for job in queue:
                        job.future.cancel()
                self._queues.clear()
            self._cv.notify_all()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
