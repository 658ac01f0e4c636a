"""What the supervisor must know of the live runs and sampling sessions to bring them back after a heal.

:class:`HealLedger` is kept in step with every verb that succeeds (:meth:`HealLedger.record`): per run its newest
training checkpoint, the optimizer step saved there and its step now, and whether gradients are pending; per
sampling session its source and, for a live run's weights, the run's step when it was snapshotted. The supervisor
(:mod:`ringtune.worker.supervisor`) restores from it; nothing here talks to a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ringtune.engine.checkpoint_layout import checkpoint_step
from ringtune.sample.pool import SamplerSource


@dataclass
class RunTrack:
    """What the supervisor knows of a live run to bring it back.

    ``checkpoint``: path of its newest training checkpoint (None: none, restore = base model, step 0);
    ``checkpoint_step``: the optimizer step saved there; ``optimizer``: whether to load the AdamW state with it
    (False after a weights-only load, until the next save); ``step``: its optimizer step now; ``pending``:
    gradients accumulated since the last optim_step (lost in a heal).
    """

    base_model: str
    checkpoint: str | None = None
    checkpoint_step: int = 0
    optimizer: bool = True
    step: int = 0
    pending: bool = False
    lora: Mapping[str, Any] | None = None  # a LoRA run's spec (LoraSpec.to_dict), None: full fine-tuning


class HealLedger:
    """The live runs (``runs``: run id -> :class:`RunTrack`) and sampling sessions (``samplers``: sampler id ->
    (source, the source run's step when snapshotted, or None)) as the verbs that succeeded left them."""

    def __init__(self) -> None:
        self.runs: dict[str, RunTrack] = {}
        self.samplers: dict[str, tuple[SamplerSource, int | None]] = {}
        self._by_verb: dict[str, Callable[[dict[str, Any], Any], None]] = {
            "create_run": self._create_run,
            "free_run": lambda a, _: self.runs.pop(a["run_id"], None),
            "forward_backward": self._forward_backward,
            "optim_step": self._optim_step,
            "save_state": self._save_state,
            "load_state": self._load_state,
            "create_sampler": self._create_sampler,
            "free_sampler": lambda a, _: self.samplers.pop(a["sampler_id"], None),
        }

    def record(self, verb: str, arguments: Mapping[str, Any], result: Any) -> None:
        """Verb ``verb`` (a :data:`~ringtune.gateway.backend.VERBS` name) succeeded with ``arguments`` (by name) and
        returned ``result``: update what a heal restores. Verbs that change nothing restorable are ignored
        (``forward_backward_many`` reports its runs through :meth:`gradients_pending`)."""
        update = self._by_verb.get(verb)
        if update is not None:
            update(dict(arguments), result)

    def gradients_pending(self, run_id: str) -> None:
        """Run ``run_id`` accumulated gradients (a forward_backward) that a heal would lose."""
        if run_id in self.runs:
            self.runs[run_id].pending = True

    def _create_run(self, a: dict[str, Any], _: None) -> None:
        self.runs[a["run_id"]] = RunTrack(a["base_model"], lora=a["lora"])

    def _forward_backward(self, a: dict[str, Any], _: Any) -> None:
        if not a["forward_only"]:
            self.gradients_pending(a["run_id"])

    def _optim_step(self, a: dict[str, Any], metrics: dict[str, float]) -> None:
        track = self.runs.get(a["run_id"])
        if track is not None:
            track.step, track.pending = int(metrics.get("step:max", track.step + 1)), False

    def _save_state(self, a: dict[str, Any], _: None) -> None:
        track = self.runs.get(a["run_id"])
        if track is not None:
            track.checkpoint, track.checkpoint_step, track.optimizer = a["path"], track.step, True

    def _load_state(self, a: dict[str, Any], _: None) -> None:
        track = self.runs.get(a["run_id"])
        if track is not None:
            step = checkpoint_step(a["path"])  # a weights-only load sets the step too (fresh moments)
            track.checkpoint, track.checkpoint_step, track.optimizer = a["path"], step, a["optimizer"]
            track.step, track.pending = step, False

    def _create_sampler(self, a: dict[str, Any], _: None) -> None:
        track = self.runs.get(a["source"].run_id or "")
        self.samplers[a["sampler_id"]] = (a["source"], track.step if track is not None else None)
