"""Requests the gateway refuses before they become futures: a JSON 4xx (or a 503 while shutting down)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ringtune.errors import UserInputError

SHUTTING_DOWN = "the server is shutting down (SIGTERM/SIGINT); this request was not executed: resend it after a restart"
"""The ``category: server`` error of a request the server will not run because it is draining."""


class RefusedError(Exception):
    """A request refused before it becomes a future: HTTP ``status`` with ``{"error", "category"}``."""

    def __init__(self, status: int, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.status, self.message, self.category = status, message, category


@contextlib.contextmanager
def refusing_bad_input(status: int = 400) -> Iterator[None]:
    """Turn a :class:`~ringtune.errors.UserInputError` raised inside the block into a :class:`RefusedError`
    ``status`` with the same message (the request is refused before it becomes a future)."""
    try:
        yield
    except UserInputError as exc:
        raise RefusedError(status, str(exc)) from None
