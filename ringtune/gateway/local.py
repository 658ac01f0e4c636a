"""LocalBackend: one :class:`~ringtune.engine.trainer.Trainer` per training run, in this process (no mesh).

The base model is loaded once at start-up (:func:`ringtune.models.checkpoints.load.load_model`: an HF
directory, a GGUF file or the embedded default) to describe it; the first run takes that copy, later runs
load their own from the source. Single process: DP = CP = 1, every call runs on the caller's thread (the
gateway's one worker thread).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.packing import max_datum_len
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.errors import UserInputError
from ringtune.gateway.backend import BackendHealth, BackendInfo
from ringtune.layout.budget import rank_token_budget
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT, load_model
from ringtune.models.decoder import CausalLM
from ringtune.sample.pool import SampleRequest, SamplerPool, SamplerSource, tokenizer_decoder
from ringtune.sample.sampler import PromptSamples

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
PAD_MULTIPLIER = 8


def budget_for_context(context_length: int, *, pad_multiplier: int = PAD_MULTIPLIER) -> int:
    """The per-rank token budget (CP = 1) whose rows fit one ``context_length``-token datum."""
    return rank_token_budget(context_length, 1, pad_multiplier=pad_multiplier)


def find_tokenizer_dir(source: str, explicit: str | None, cache_dir: str | Path | None) -> str | None:
    """The tokenizer directory to report: ``explicit``; else the source HF dir if it has ``tokenizer.json``;
    else, for the embedded default, SmolLM2's tokenizer built once under ``cache_dir``; else None."""
    if explicit is not None:
        path = Path(explicit).resolve()
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise UserInputError(f"tokenizer dir {explicit!r} has neither tokenizer.json nor tokenizer_config.json")
        return str(path)
    src = Path(source)
    if src.is_dir() and (src / "tokenizer.json").is_file():
        return str(src.resolve())
    if source == EMBEDDED_DEFAULT and cache_dir is not None:
        from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir

        dest = Path(cache_dir).resolve() / "smollm2-135m"
        if not (dest / "tokenizer.json").is_file():
            smollm2_tokenizer_dir(dest)
        return str(dest)
    return None


def engine_modes(options: Mapping[str, object]) -> dict[str, object]:
    """The :class:`Trainer` options that shape the numbers, with their defaults (``BackendInfo.modes``)."""
    from ringtune.ops.cp_modes import DEFAULT_ATTENTION, DEFAULT_GATED_DELTA

    return {
        "attention": options.get("attention", DEFAULT_ATTENTION),
        "gated_delta": options.get("gated_delta", DEFAULT_GATED_DELTA),
        "pad_multiplier": int(options.get("pad_multiplier", PAD_MULTIPLIER)),  # type: ignore[arg-type]
        "debug_fault": options.get("debug_fault"),
    }


class LocalBackend:
    """The :class:`~ringtune.gateway.backend.Backend` of one process: a ``Trainer(model, None, ...)`` per run.

    Args:
        source: what :func:`load_model` reads (HF dir, ``.gguf`` file, or ``smollm2-135m``).
        max_tokens_per_rank: the engine's per-rank budget (see :func:`budget_for_context`).
        dtype: ``float32`` / ``bfloat16`` / ``float64``.
        model_name: the name clients pass as ``base_model`` (default: ``source``); ``source`` is accepted too.
        tokenizer_dir, tokenizer_cache: see :func:`find_tokenizer_dir`.
        trainer_options: extra keyword arguments of :class:`Trainer` (``attention``, ``gated_delta``, ...).
    """

    def __init__(
        self,
        source: str,
        *,
        max_tokens_per_rank: int,
        dtype: str = "float32",
        model_name: str | None = None,
        tokenizer_dir: str | None = None,
        tokenizer_cache: str | Path | None = None,
        trainer_options: Mapping[str, object] | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise UserInputError(f"dtype={dtype!r} must be one of {list(DTYPES)}")
        self.source, self.dtype = str(source), DTYPES[dtype]
        self.max_tokens_per_rank = max_tokens_per_rank
        self.options = dict(trainer_options or {})
        self.pad_multiplier = int(self.options.get("pad_multiplier", PAD_MULTIPLIER))
        context = max_datum_len(max_tokens_per_rank, cp_size=1, multiple=self.pad_multiplier)
        if context < 1:
            raise UserInputError(f"max_tokens_per_rank={max_tokens_per_rank} holds no datum; use >= 16")
        self._spare: CausalLM | None = load_model(self.source, dtype=self.dtype)
        config = self._spare.config
        name = model_name or self.source
        self._info = BackendInfo(
            model_name=name,
            aliases=tuple(a for a in (self.source,) if a != name),
            arch=config.model_type,
            tokenizer_dir=find_tokenizer_dir(self.source, tokenizer_dir, tokenizer_cache),
            context_length=context,
            max_tokens_per_rank=max_tokens_per_rank,
            dtype=dtype,
            vocab_size=config.vocab_size,
            modes=engine_modes(self.options),
        )
        self.trainers: dict[str, Trainer] = {}
        self.samplers = SamplerPool(
            lambda path: load_model(path or self.source, dtype=self.dtype),
            decode=tokenizer_decoder(self._info.tokenizer_dir),
        )

    def info(self) -> BackendInfo:
        return self._info

    def health(self) -> BackendHealth:
        return BackendHealth(ok=True, extra={"live_runs": float(len(self.trainers))})

    def _model(self) -> CausalLM:
        model, self._spare = self._spare, None
        return model if model is not None else load_model(self.source, dtype=self.dtype)

    def create_run(self, run_id: str, base_model: str) -> None:
        if base_model not in (self._info.model_name, *self._info.aliases):
            raise UserInputError(f"base_model={base_model!r} is not served here; use {self._info.model_name!r}")
        if run_id in self.trainers:
            raise RuntimeError(f"run {run_id} exists already")
        self.trainers[run_id] = Trainer(
            self._model(), None, max_tokens_per_rank=self.max_tokens_per_rank, **self.options
        )

    def free_run(self, run_id: str) -> None:
        if self.trainers.pop(run_id, None) is not None:
            gc.collect()

    def _trainer(self, run_id: str) -> Trainer:
        trainer = self.trainers.get(run_id)
        if trainer is None:
            raise RuntimeError(f"run {run_id} is not live on this backend (live: {sorted(self.trainers)})")
        return trainer

    def forward_backward(
        self,
        run_id: str,
        data: Sequence[TrainDatum],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        result = self._trainer(run_id).forward_backward(data, loss_fn, loss_config, forward_only=forward_only)
        assert result.outputs is not None  # a single process is the result rank
        return result.outputs, result.metrics

    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        return self._trainer(run_id).optim_step(adam)

    def save_state(self, run_id: str, path: str) -> None:
        self._trainer(run_id).save_state(path)

    def load_state(self, run_id: str, path: str, optimizer: bool) -> None:
        self._trainer(run_id).load_state(path, optimizer=optimizer)

    def export_for_sampler(self, run_id: str, path: str) -> None:
        self._trainer(run_id).export_hf(path)

    def create_sampler(self, sampler_id: str, source: SamplerSource) -> None:
        self.samplers.create(sampler_id, source, self.trainers)

    def free_sampler(self, sampler_id: str) -> None:
        self.samplers.free(sampler_id)

    def sample(self, sampler_id: str, requests: Sequence[SampleRequest]) -> list[PromptSamples]:
        return self.samplers.sample(sampler_id, requests)

    def close(self) -> None:
        self.trainers.clear()
        self.samplers.snapshots.clear()
        self._spare = None
        gc.collect()
