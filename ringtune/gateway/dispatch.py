"""Per-run ordering and dispatch of the gateway's jobs: from a request to a resolved future.

Threading: every method but :meth:`Dispatcher.drain` and :meth:`Dispatcher.shutdown` runs on the event loop thread
(no locks). Backend calls run as jobs on one worker thread (:class:`~ringtune.gateway.scheduler.FairExecutor`: a
FIFO queue per training run, served round-robin, so ops dispatched in ``seq_id`` order run in that order and one
run's burst does not hold the others back); a job returns an :class:`~ringtune.gateway.futures.Outcome` and,
optionally, a commit that updates the state on the loop thread once it is done.

Errors: inside a job a :class:`~ringtune.errors.UserInputError` fails its future with ``category: user`` (its
``seq_id`` is consumed and later ops go on); any other exception fails it with ``category: server``. A bad
``seq_id`` is refused before a future exists (:class:`~ringtune.gateway.refusal.RefusedError`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from typing import Any

from ringtune.errors import RankFailedError, UserInputError
from ringtune.gateway import translate
from ringtune.gateway.futures import FutureStore, Outcome
from ringtune.gateway.refusal import SHUTTING_DOWN, RefusedError
from ringtune.gateway.scheduler import DEFAULT_KEY, FairExecutor
from ringtune.gateway.state import RunRecord

log = logging.getLogger(__name__)

Commit = Callable[[], None]
"""A state change a job hands back, applied on the loop thread once the job succeeded."""
Job = Callable[[], tuple[Outcome, Commit | None]]
Joinable = tuple[Hashable, Any, Callable[[list[Any]], list[tuple[Outcome, Commit | None]]]]
"""(kind, item, runner) of a request that may share a backend call (FairExecutor.submit_joinable)."""


class Dispatcher:
    """Runs jobs on the backend thread and resolves their futures; keeps each run's ops in ``seq_id`` order.

    Args:
        futures: where requests become futures and get their outcomes.
        executor: the one backend thread (queues per key, joinable jobs).

    Attributes:
        notices: run id -> the ``category: server`` error its next op gets instead of running (a run restored
            after a restart of the server, :mod:`ringtune.gateway.restore`).
        stopping: set by :meth:`drain`: jobs not started yet fail with ``category: server``.
    """

    def __init__(self, futures: FutureStore, executor: FairExecutor) -> None:
        self.futures, self.executor = futures, executor
        self.notices: dict[str, str] = {}
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the gateway lives on (commits and :meth:`loop_call` run there)."""
        self._loop = loop

    def loop_call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop thread (from the worker thread)."""
        assert self._loop is not None, "bind_loop() was not called (the app's lifespan does it)"
        self._loop.call_soon_threadsafe(fn)

    def dispatch(self, request_id: str, job: Job, key: str = DEFAULT_KEY, join: Joinable | None = None) -> None:
        """Run ``job`` on the worker thread, queued under ``key`` (a run's id: its ops keep their order); resolve
        future ``request_id`` (and apply its commit) back on the loop. With ``join`` = (kind, item, runner) the
        request is queued as a joinable job instead (a LoRA pass, :mod:`ringtune.gateway.passes`; the runner never
        raises) and ``job`` is not used."""

        def guarded() -> tuple[Outcome, Commit | None]:
            try:
                return job()
            except UserInputError as exc:
                return Outcome.error(str(exc), "user"), None
            except RankFailedError as exc:  # a rank failed or died; the message says what happened and what next
                log.error("request %s failed: %s", request_id, exc)
                return Outcome.error(str(exc), "server"), None
            except Exception as exc:
                log.exception("request %s failed", request_id)
                return Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server"), None

        def done(fut: asyncio.Future) -> None:
            if fut.cancelled():  # still queued when the server began to shut down
                self.futures.resolve(request_id, Outcome.error(SHUTTING_DOWN, "server"))
                return
            outcome, commit = fut.result()
            if commit is not None and outcome.kind != "error":
                try:
                    commit()
                except Exception as exc:
                    log.exception("commit of %s failed", request_id)
                    outcome = Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server")
            self.futures.resolve(request_id, outcome)

        if self.stopping:
            self.futures.resolve(request_id, Outcome.error(SHUTTING_DOWN, "server"))
            return
        if join is not None:
            future = self.executor.submit_joinable(key, join[0], join[1], join[2])
        else:
            future = self.executor.submit_for(key, guarded)
        asyncio.wrap_future(future).add_done_callback(done)

    def ordered(
        self, record: RunRecord, seq_id: int | None, op: str, job: Job, join: Joinable | None = None
    ) -> dict[str, Any]:
        """Submit op ``op`` of ``record``'s run in ``seq_id`` order; ``{"request_id", "model_id"}``. A resubmitted
        ``seq_id`` gets the original request_id; the first op of a restored run answers its notice instead of
        running. RefusedError 400 for a bad or spent ``seq_id``."""
        try:
            seq = translate.check_seq_id(seq_id)
        except UserInputError as exc:
            raise RefusedError(400, str(exc)) from None
        known = record.gate.request_for(seq)
        if known is not None:
            return {"request_id": known, "model_id": record.run_id}
        request_id = self.futures.create(op)

        def dispatch() -> None:  # in seq_id order
            notice = self.notices.pop(record.run_id, None)
            if notice is not None:
                self.futures.resolve(request_id, Outcome.error(notice, "server"))
            else:
                self.dispatch(request_id, job, record.run_id, join)

        try:
            record.gate.add(seq, request_id, dispatch, self.futures.clock())
        except UserInputError as exc:
            self.futures.resolve(request_id, Outcome.error(str(exc), "user"))
            raise RefusedError(400, str(exc)) from None
        record.touch()
        return {"request_id": request_id, "model_id": record.run_id}

    async def on_backend(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the backend thread, awaited (a route that answers synchronously); while the server shuts
        down (SIGTERM drain) a JSON 503 ``category: server`` instead of running it."""
        if self.stopping:
            raise RefusedError(503, SHUTTING_DOWN, "server")
        try:
            future = self.executor.submit(fn)
        except RuntimeError:  # the backend thread was shut down meanwhile
            raise RefusedError(503, SHUTTING_DOWN, "server") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled():  # still queued when the drain began
                raise RefusedError(503, SHUTTING_DOWN, "server") from None
            raise

    def drain(self) -> None:
        """Shutdown, first part (any thread): queued and later jobs fail with ``category: server``; returns once
        the job running now has finished (its result stays retrievable)."""
        self.stopping = True
        self.executor.shutdown(wait=True, cancel_futures=True)

    def shutdown(self) -> None:
        """Stop the backend thread after the jobs queued now (any thread)."""
        self.executor.shutdown(wait=True)
