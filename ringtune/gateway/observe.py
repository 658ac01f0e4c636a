"""Observability of the backend verbs: one log line per operation and a JSONL metrics file per training run.

:class:`ObservedBackend` wraps any :class:`~ringtune.gateway.backend.Backend`: every verb logs
``op=<verb> model=<run> datums=<n> tokens=<n> seconds=<s> ok|error`` on the ``ringtune.ops`` logger, and the
metrics of ``forward_backward`` / ``forward`` / ``optim_step`` are appended, one JSON object per line, to
``<checkpoint_root>/<run_id>/metrics.jsonl`` with the wall time and the op (optim_step's metrics carry the
trainer's ``step:max``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.gateway.backend import Backend, BackendHealth, BackendInfo
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.sampler import PromptSamples

log = logging.getLogger("ringtune.ops")


def _tokens(data: Sequence[TrainDatum]) -> int:
    total = 0
    for d in data:
        try:
            total += len(d.tokens)
        except TypeError:
            pass
    return total


class ObservedBackend:
    """``backend`` with a log line per verb and per-run metrics files under ``root`` (see the module docstring)."""

    def __init__(self, backend: Backend, root: str | Path) -> None:
        self.backend, self.root = backend, Path(root)

    def info(self) -> BackendInfo:
        return self.backend.info()

    def health(self) -> BackendHealth:
        return self.backend.health()

    def _observe(self, op: str, run_id: str | None, call: Callable[[], Any], **fields: Any) -> Any:
        start = time.perf_counter()
        status = "ok"
        try:
            return call()
        except Exception as exc:
            status = f"error={type(exc).__name__}"
            raise
        finally:
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            seconds = time.perf_counter() - start
            log.info("op=%s model=%s %s seconds=%.3f %s", op, run_id, extra, seconds, status)

    def _record(self, run_id: str, op: str, metrics: Mapping[str, float]) -> None:
        path = self.root / run_id / "metrics.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            line = {"time": time.time(), "op": op, **metrics}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:  # metrics are best effort: never fail a training op over them
            log.warning("metrics file %s not written: %s", path, exc)

    def create_run(self, run_id: str, base_model: str, lora: Mapping[str, Any] | None = None) -> None:
        self._observe("create_run", run_id, lambda: self.backend.create_run(run_id, base_model, lora))

    def free_run(self, run_id: str) -> None:
        self._observe("free_run", run_id, lambda: self.backend.free_run(run_id))

    def forward_backward(
        self,
        run_id: str,
        data: Sequence[TrainDatum],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        op = "forward" if forward_only else "forward_backward"
        outputs, metrics = self._observe(
            op,
            run_id,
            lambda: self.backend.forward_backward(run_id, data, loss_fn, loss_config, forward_only),
            loss_fn=loss_fn,
            datums=len(data),
            tokens=_tokens(data),
        )
        self._record(run_id, op, metrics)
        return outputs, metrics

    def forward_backward_many(
        self,
        run_ids: Sequence[str],
        data: Sequence[Sequence[TrainDatum]],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> list[tuple[list[dict[str, torch.Tensor]], dict[str, float]] | Exception]:
        op = "forward" if forward_only else "forward_backward"
        results = self._observe(
            f"{op}_many",
            ",".join(run_ids),
            lambda: self.backend.forward_backward_many(run_ids, data, loss_fn, loss_config, forward_only),
            loss_fn=loss_fn,
            runs=len(run_ids),
            datums=sum(len(d) for d in data),
            tokens=sum(_tokens(d) for d in data),
        )
        for run_id, result in zip(run_ids, results, strict=True):
            if not isinstance(result, Exception):  # a run's own error (user, or a restored run's notice)
                self._record(run_id, op, result[1])
        return results

    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        metrics = self._observe("optim_step", run_id, lambda: self.backend.optim_step(run_id, adam))
        self._record(run_id, "optim_step", metrics)
        return metrics

    def save_state(self, run_id: str, path: str) -> None:
        self._observe("save_state", run_id, lambda: self.backend.save_state(run_id, path), path=path)

    def load_state(self, run_id: str, path: str, optimizer: bool) -> None:
        self._observe("load_state", run_id, lambda: self.backend.load_state(run_id, path, optimizer), path=path)

    def export_for_sampler(self, run_id: str, path: str) -> None:
        self._observe("export_for_sampler", run_id, lambda: self.backend.export_for_sampler(run_id, path), path=path)

    def create_sampler(self, sampler_id: str, source: SamplerSource) -> None:
        self._observe("create_sampler", source.run_id, lambda: self.backend.create_sampler(sampler_id, source))

    def free_sampler(self, sampler_id: str) -> None:
        self._observe("free_sampler", None, lambda: self.backend.free_sampler(sampler_id))

    def sample(
        self,
        sampler_id: str,
        requests: Sequence[SampleRequest],
        *,
        job_id: str | None = None,
        slice_s: float | None = None,
    ) -> list[PromptSamples] | None:
        return self._observe(
            "sample",
            sampler_id,
            lambda: self.backend.sample(sampler_id, requests, job_id=job_id, slice_s=slice_s),
            requests=len(requests),
            sequences=sum(r.num_samples for r in requests),
        )

    def sample_more(self, job_id: str, slice_s: float | None = None) -> list[PromptSamples] | None:
        return self._observe("sample_more", None, lambda: self.backend.sample_more(job_id, slice_s), job=job_id)

    def probe(self, name: str) -> dict[str, Any]:
        return self._observe("probe", None, lambda: self.backend.probe(name), probe=name)

    def close(self) -> None:
        self.backend.close()
