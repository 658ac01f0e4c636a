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
