"""Control collectives: objects and verdicts over a mesh's control group (gloo), never the data path.

What a request-serving engine needs so that every rank does the same thing:

- :func:`broadcast_object`: a request (any picklable object) from the source rank to every rank;
- :func:`agree`: every rank learns whether any rank failed, and every rank raises the same error (the
  first failing rank's), so no rank goes on into a collective that another rank will never enter.
  Verdicts travel through the store, waits bounded by liveness (:mod:`ringtune.parallel.liveness`): a dead
  rank is named within seconds, a rank that is still computing (or starved, or stopped) is waited for;
- :func:`gather_object_to` / :func:`all_gather_objects`: per-rank objects onto one rank (results) or all;
- :func:`run_on_source`: run a function on one rank (a file write), give its result or error to all.

None of them is a gloo collective: every one goes through the store (:mod:`ringtune.parallel.store_exchange`),
so a rank that waits here while another rank works alone (decodes a long generation, writes a file) waits on
that rank's liveness, for as long as it takes, never on a collective's timeout.

``group=None`` means a single process: every function is then local (no communication). All ranks of
``group`` must call each function together, in the same order.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ringtune.errors import RankFailedError, UserInputError
from ringtune.parallel.store_exchange import broadcast_from, exchange_objects, gather_objects_to

T = TypeVar("T")

NOT_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""BaseExceptions that end the process rather than a request; everything else (DCP's CheckpointException is a
BaseException) is caught and agreed on."""


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def broadcast_object(obj: Any, group: dist.ProcessGroup | None, *, src: int = 0) -> Any:
    """``obj`` of group rank ``src`` on every rank of ``group`` (others pass anything, e.g. None)."""
    if group is None or _size(group) == 1:
        return obj
    return broadcast_from(obj, group, src=src)


def gather_object_to(obj: Any, group: dist.ProcessGroup | None, *, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in group-rank order on ``dst``; None on the other ranks (which do not wait)."""
    if group is None or _size(group) == 1:
        return [obj]
    return gather_objects_to(obj, group, dst=dst)


def _portable(error: BaseException, rank: int) -> BaseException:
    """``error`` itself if it survives pickling (same type and message elsewhere), else a RankFailedError."""
    described = f"{type(error).__name__}: {error}"
    if isinstance(error, UserInputError | RankFailedError):
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:
            return UserInputError(str(error))
    return RankFailedError(f"rank {rank} failed: {described}", rank=rank, error_type=type(error).__name__)


def _is_peer_symptom(error: BaseException) -> bool:
    """Whether ``error`` looks like the echo of another rank's failure (a collective that timed out or lost
    its peer) rather than a cause of its own."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        needle in text for needle in ("Timed out", "timed out", "Connection closed", "Connection reset", "peer")
    )


def _choose(verdicts: list[Any]) -> tuple[int, BaseException]:
    """The error every rank raises: the lowest rank's user error, else the lowest rank's cause (an error that
    is not merely a peer's timeout), else the lowest rank's error; a RankFailedError names the others too."""
    failed = [(r, e) for r, e in enumerate(verdicts) if e is not None]
    users = [(r, e) for r, e in failed if isinstance(e, UserInputError)]
    if users:
        return users[0]
    causes = [(r, e) for r, e in failed if not _is_peer_symptom(e)] or failed
    rank, first = causes[0]
    others = [r for r, _ in failed if r != rank]
    if isinstance(first, RankFailedError) and others:
        note = f" (ranks {', '.join(map(str, others))} failed too, waiting on it)"
        return rank, RankFailedError(str(first) + note, rank=first.rank, error_type=first.error_type)
    return rank, first


def agree(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Collective verdict: return on every rank if no rank passed an error, else raise on every rank.

    Every rank raises the same error (:func:`_choose`): a :class:`UserInputError` (or subclass) travels as
    itself, with its message; anything else becomes a :class:`RankFailedError` naming the rank, the original
    type and message (chained to the local exception where there is one, for its traceback).
    """
    if group is None or _size(group) == 1:
        if error is not None:
            raise error
        return
    rank = _rank(group)
    mine = None if error is None else _portable(error, rank)
    verdicts = exchange_objects(mine, group)
    if all(v is None for v in verdicts):
        return
    chosen_rank, chosen = _choose(verdicts)
    if chosen_rank == rank and mine is error and error is not None:
        raise error
    raise chosen from error


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``(fn(), None)``, or ``(None, the exception)`` for anything but :data:`NOT_CAUGHT` (which propagates)."""
    try:
        return fn(), None
    except NOT_CAUGHT:
        raise
    except BaseException as exc:
        return None, exc


def agreed_call(fn: Callable[[], T], group: dist.ProcessGroup | None) -> T:
    """Run ``fn()`` on every rank, then :func:`agree` on whether it raised anywhere; its value if none did."""
    value, error = attempt(fn)
    agree(error, group)
    return value  # type: ignore[return-value]


def run_on_source(fn: Callable[[], T], group: dist.ProcessGroup | None, *, src: int = 0) -> T:
    """Run ``fn`` on group rank ``src`` only and return its result on every rank (doubles as a barrier).

    If ``fn`` raises on ``src``, every rank raises (see :func:`agree` for which error).
    """
    value, error = attempt(fn) if _rank(group) == src else (None, None)
    if _size(group) == 1:
        if error is not None:
            raise error
        return value  # type: ignore[return-value]  # fn ran without raising: value is its T
    box = broadcast_object((error is None, value if error is None else _portable(error, src)), group, src=src)
    ok, payload = box
    if ok:
        return payload
    if error is not None:
        raise error
    raise payload


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's small ``obj`` in group-rank order, on every rank (through the store, with liveness:
    :func:`ringtune.parallel.store_exchange.exchange_objects`)."""
    if group is None or _size(group) == 1:
        return [obj]
    return exchange_objects(obj, group)
