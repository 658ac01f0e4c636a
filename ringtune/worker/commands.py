"""The commands rank 0 publishes and every rank executes: small picklable records of one Tinker verb each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OPS = (
    "create_run",
    "free_run",
    "forward_backward",
    "forward_backward_many",
    "optim_step",
    "save_state",
    "load_state",
    "export_hf",
    "create_sampler",
    "free_sampler",
    "sample",
    "sample_more",
    "probe",
    "ping",
    "shutdown",
)
"""Every command name :class:`~ringtune.worker.executor.RankExecutor` executes."""


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
