"""The loop of every worker rank but rank 0: receive a command, execute it, repeat until shutdown.

Commands come through the job's store (:func:`ringtune.parallel.store_exchange.receive_object`): an idle worker waits
for as long as rank 0 is alive (no timeout to tune) and exits when rank 0 dies or sends ``shutdown``.
"""

from __future__ import annotations

import logging

from ringtune.errors import RankFailedError, UserInputError
from ringtune.parallel.store_exchange import receive_object
from ringtune.worker.served_models import ServedModels

log = logging.getLogger(__name__)

CHANNEL = "worker"
"""The command channel's name in the store."""


def worker_loop(executor: ServedModels, *, src: int = 0) -> int:
    """Execute rank ``src``'s commands until ``shutdown`` (returns 0) or until rank ``src`` is gone (returns 1).

    A command that fails is agreed by every rank (the executor) and answered by rank ``src``; the loop goes on,
    unless the mesh lost a rank (a trainer is broken), when it returns 1 so the process exits.
    """
    while True:
        try:
            command = receive_object(CHANNEL, src=src)
        except RankFailedError as exc:
            log.error("worker: rank %d is gone (%s); exiting", src, exc)
            return 1
        except Exception as exc:  # the store itself is gone: rank 0's process ended
            log.error("worker: the command channel failed (%s: %s); exiting", type(exc).__name__, exc)
            return 1
        try:
            executor.execute(command)
        except (UserInputError, RankFailedError) as exc:
            log.info("worker: %s refused: %s", command.op, exc)
        if command.op == "shutdown":
            return 0
        if executor.broken:
            log.error("worker: %s; exiting", executor.broken)
            return 1
