"""One exception hierarchy for errors caused by what a user asked for.

A ``UserInputError`` means the request is wrong (a field, its value and the limit are in the
message) and nothing was changed. Anything else escaping ringtune is a bug.
"""


class UserInputError(ValueError):
    """A request, config or batch that ringtune refuses; the message names the field, value and limit."""


class LayoutError(UserInputError):
    """A packed row or CP/TP setting that the zigzag layout cannot represent."""


class ParallelConfigError(UserInputError):
    """A parallel mode that does not fit the model or mesh (e.g. heads not divisible by CP)."""


class NonFiniteError(UserInputError):
    """A request whose loss, gradient or update is not finite (inf/NaN); it was refused and changed nothing."""


class RankFailedError(RuntimeError):
    """Another rank of the group failed with a server-side error (a bug, a fault, a dead peer).

    Attributes:
        rank: the group rank that failed first; ``error_type``: its exception's class name.
    """

    def __init__(self, message: str, *, rank: int = -1, error_type: str = "RuntimeError") -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type

    def __reduce__(self):
        return (_rank_failed_error, (str(self), self.rank, self.error_type))


def _rank_failed_error(message: str, rank: int, error_type: str) -> RankFailedError:
    return RankFailedError(message, rank=rank, error_type=error_type)


class ServerConfigError(RuntimeError):
    """The server's configuration cannot do what a client asked: a ``category: server`` error, never ``user``.

    ``ringtune serve`` checks every setting at start-up (:mod:`ringtune.worker.preflight`); the workers raise
    this if a setting those checks passed is refused later (a gap in the checks, not the client's fault).
    """
