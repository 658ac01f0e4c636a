"""Counting the bytes this process sends, for benchmarks and tests.

Every ringtune collective reports what it sends with :func:`record_sent`. Counting is off unless a
:func:`measure_comm` block is active in the calling thread (a context variable, not process-group
state): ``with measure_comm() as meter: ...; meter.bytes_sent``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class CommMeter:
    """Bytes sent by this process, in total and per operation name."""

    bytes_sent: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[CommMeter | None] = contextvars.ContextVar("ringtune_comm_meter", default=None)


def record_sent(op: str, *tensors: torch.Tensor) -> None:
    """Add the bytes of ``tensors`` (what this rank puts on the wire) to the active meter, if any."""
    meter = _ACTIVE.get()
    if meter is None:
        return
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    meter.bytes_sent += nbytes
    meter.by_op[op] = meter.by_op.get(op, 0) + nbytes


@contextlib.contextmanager
def measure_comm() -> Iterator[CommMeter]:
    """Count bytes sent inside the block (autograd backward runs in the same thread on CPU)."""
    meter = CommMeter()
    token = _ACTIVE.set(meter)
    try:
        yield meter
    finally:
        _ACTIVE.reset(token)
