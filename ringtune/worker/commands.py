"""The commands rank 0 publishes and every rank executes: small picklable records of one Tinker verb each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringtune.gateway.backend import VERBS

OPS = (*(v.command for v in VERBS.values() if v.command is not None), "ping", "shutdown")
"""Every command name :class:`~ringtune.worker.executor.RankExecutor` executes: the commands of the verb table
(:data:`ringtune.gateway.backend.VERBS`), ``ping`` and ``shutdown``."""


@dataclass(frozen=True)
class Command:
    """One verb for every rank: ``op`` (one of :data:`OPS`), the training run it addresses, its arguments.

    ``args`` holds plain values only (str, bool, numbers, dicts, lists of ``TrainDatum`` with CPU tensors,
    ``AdamParams``): it travels pickled through the job's store to every rank.
    """

    op: str
    run_id: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"command op {self.op!r}: choose one of {OPS}")
