"""LocalBackend: the gateway's backend in this one process (no mesh): DP = CP = 1.

The same :class:`~ringtune.worker.backend.DistributedBackend` as a multi-rank server, over a
:class:`~ringtune.worker.executor.RankExecutor` without a mesh: one Trainer per training run, sampler snapshots,
every verb executed on the caller's thread (the gateway's one backend thread), no command channel. The base
model is loaded once at start-up (:func:`ringtune.models.checkpoints.load.load_model`: an HF directory, a GGUF
file or the embedded default) to describe it; the first run takes that copy, later runs load their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ringtune.models.checkpoints.load import load_model
from ringtune.models.precision import check_precision
from ringtune.worker.backend import DistributedBackend
from ringtune.worker.describe import describe
from ringtune.worker.executor import ModelSpec, RankExecutor


class LocalBackend(DistributedBackend):
    """The :class:`~ringtune.gateway.backend.Backend` of one process: a ``Trainer(model, None, ...)`` per run.

    Args:
        source: what :func:`load_model` reads (HF dir, ``.gguf`` file, or ``smollm2-135m``).
        max_tokens_per_rank: the engine's per-rank budget.
        dtype: a precision of :data:`ringtune.models.precision.PRECISIONS` (``float32``, ``bfloat16``, ``float64``,
            ``bf16-mixed``).
        model_name: the name clients pass as ``base_model`` (default: ``source``); ``source`` is accepted too.
        tokenizer_dir, tokenizer_cache: see :func:`ringtune.worker.describe.find_tokenizer_dir`.
        trainer_options: extra keyword arguments of :class:`Trainer` (``attention``, ``gated_delta``, ...).
        mesh_prompt_tokens: see :class:`ModelSpec` (``max_tokens=1`` requests of prompts this long run
            through the training forward instead of a prefill with a cache).
        record_routing: sampled sequences of a MoE model carry their routing (``--routing-replay``).
        shared_decode: sampling requests decode in one batch per base model (``--shared-decode``).
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
        mesh_prompt_tokens: int | None = None,
        record_routing: bool = False,
        shared_decode: bool = True,
    ) -> None:
        precision = check_precision(dtype)
        spec = ModelSpec(
            source=str(source),
            dtype=dtype,
            max_tokens_per_rank=max_tokens_per_rank,
            trainer_options=dict(trainer_options or {}),
            mesh_prompt_tokens=mesh_prompt_tokens,
            record_routing=record_routing,
            shared_decode=shared_decode,
        )
        model = load_model(spec.source, dtype=precision.param_dtype)
        info = describe(
            spec, model, model_name=model_name, tokenizer_dir=tokenizer_dir, tokenizer_cache=tokenizer_cache
        )
        spec = replace(spec, tokenizer_dir=info.tokenizer_dir)
        super().__init__(RankExecutor(spec, None, spare=model), info)

    @property
    def trainers(self) -> dict:
        """The live runs' trainers (run id -> Trainer)."""
        return self.executor.trainers
