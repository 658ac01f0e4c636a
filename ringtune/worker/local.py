"""LocalBackend: the gateway's backend in this one process (no mesh): DP = CP = 1.

The same :class:`~ringtune.worker.backend.DistributedBackend` as a multi-rank server, over a
:class:`~ringtune.worker.executor.RankExecutor` without a mesh: one Trainer per training run, sampler snapshots,
every verb executed on the caller's thread (the gateway's one backend thread), no command channel. Each served
base model is loaded once at start-up (:func:`ringtune.models.checkpoints.load.load_model`: an HF directory, a
GGUF file or the embedded default) to describe it; its first run takes that copy, later runs load their own.
Several models (``more_models``) each get their own executor (:mod:`ringtune.worker.served_models`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ringtune.models.precision import check_precision
from ringtune.worker.backend import DistributedBackend
from ringtune.worker.executor import ModelSpec
from ringtune.worker.launch import WorkerLayout, load_and_describe
from ringtune.worker.served_models import ServedModels


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
        device_type: ``cpu`` or ``cuda`` (the process's GPU 0): where the model and every tensor of it lives.
        more_models: further served models as ``(name, source)`` pairs (name None: the source), on the same
            settings; each finds its own tokenizer.
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
        device_type: str = "cpu",
        more_models: Sequence[tuple[str | None, str]] = (),
    ) -> None:
        check_precision(dtype)
        specs = [
            ModelSpec(
                source=str(path),
                name=name,
                dtype=dtype,
                max_tokens_per_rank=max_tokens_per_rank,
                trainer_options=dict(trainer_options or {}),
                mesh_prompt_tokens=mesh_prompt_tokens,
                record_routing=record_routing,
                shared_decode=shared_decode,
                device_type=device_type,
            )
            for name, path in [(model_name, source), *more_models]
        ]
        self._serve(specs, tokenizer_dir, tokenizer_cache)

    def _serve(self, specs: Sequence[ModelSpec], tokenizer_dir: str | None, tokenizer_cache: str | Path | None) -> None:
        layout = WorkerLayout(device_type=specs[0].device_type)
        served = load_and_describe(specs, layout, tokenizer_dir, tokenizer_cache)
        super().__init__(ServedModels(served.specs, None, spares=served.spares), served.infos)

    @classmethod
    def of_specs(
        cls,
        specs: Sequence[ModelSpec],
        *,
        tokenizer_dir: str | None = None,
        tokenizer_cache: str | Path | None = None,
    ) -> LocalBackend:
        """The one-process backend of the served models ``specs`` (``ringtune serve`` with DP = CP = 1; each spec
        carries its own trainer options); ``tokenizer_dir`` is the first model's."""
        backend = cls.__new__(cls)
        backend._serve(specs, tokenizer_dir, tokenizer_cache)
        return backend

    @property
    def trainers(self) -> dict:
        """The live runs' trainers of every served model (run id -> Trainer; a new dict)."""
        return self.executor.trainers
