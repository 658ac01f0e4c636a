"""The Backend protocol: the Tinker verbs the gateway needs from whatever holds the models.

Every method is synchronous, blocking compute; the gateway calls them from one worker thread, in
submission order (FIFO, which keeps each run's ``seq_id`` order), never from its event loop. Arguments are
plain picklable values (str, bool, dicts of numbers, :class:`~ringtune.engine.trainer.TrainDatum` of CPU
tensors, :class:`~ringtune.engine.optimizer.AdamParams`), so a multi-rank backend can broadcast them as a
command to its worker processes. Paths are absolute and already checked by the gateway (inside its
checkpoint root; for several hosts that root must be a shared filesystem).

Errors: :class:`~ringtune.errors.UserInputError` means the request was refused before anything changed (the
gateway answers ``category: user``); any other exception is a server error.

The protocol is also the one table of verbs (:data:`VERBS`): each method's ``@verb`` declaration says which worker
command runs it on every rank and which run or sampling session it addresses; the observer
(:mod:`ringtune.gateway.observe`), the supervisor (:mod:`ringtune.worker.supervisor`) and rank 0's command
publisher (:mod:`ringtune.worker.backend`) derive their methods from it (:func:`~ringtune.gateway.verbs.forward_verbs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.errors import UserInputError
from ringtune.gateway.verbs import Verb, verb, verbs_of
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.sampler import PromptSamples


@dataclass(frozen=True, kw_only=True)
class BackendInfo:
    """What the gateway reports about the served model (``get_info``, capabilities, ``ringtune serve``).

    Attributes:
        model_name: the base model name clients pass to ``create_model`` (also ``model_data.model_name``).
        aliases: other names accepted for it (e.g. the source path).
        arch: the architecture (``model_type`` of the HF config).
        tokenizer_dir: absolute local directory with ``tokenizer.json`` (``model_data.tokenizer_id``), or None.
        context_length: the longest datum (tokens) one request may hold.
        max_tokens_per_rank: the per-rank token budget of a microbatch.
        dp_size, cp_size: the data- and context-parallel layout (1, 1 for the local backend).
        dtype: the parameter dtype name.
        vocab_size: the model's vocabulary (embedding rows).
        modes: the engine options that shape the numbers (``attention``, ``gated_delta``, ``pad_multiplier``,
            ``debug_fault``), reported for the parity client (``ringtune parity run`` records them).
        param_count: parameters of the served model (0: unknown; ``max_live_runs`` then counts runs).
        lora_params_per_rank: LoRA parameters per unit of rank by target group (``attn``, ``mlp``, ``unembed``;
            a group absent: not adaptable), for memory admission (:mod:`ringtune.gateway.run_memory`).
        image_dir: the checkpoint directory whose ``config.json`` and ``preprocessor_config.json`` decode image
            chunks (:mod:`ringtune.gateway.images`), for a served model that takes images; None: image chunks are
            refused (a text model, or a vision-language checkpoint loaded without its vision tower).
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    arch: str
    tokenizer_dir: str | None
    context_length: int
    max_tokens_per_rank: int
    dp_size: int = 1
    cp_size: int = 1
    dtype: str
    vocab_size: int
    modes: Mapping[str, object] = field(default_factory=dict)
    param_count: int = 0
    lora_params_per_rank: Mapping[str, int] = field(default_factory=dict)
    image_dir: str | None = None


@dataclass(frozen=True)
class BackendHealth:
    """``ok`` False once the backend cannot serve any more (e.g. a rank died); ``detail`` says why."""

    ok: bool
    detail: str = ""
    extra: dict[str, float | str] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """The training verbs, per training run (``run_id`` = the Tinker model id)."""

    @verb()
    def info(self) -> BackendInfo:
        """The first served model's description (cheap; may be called from the event loop)."""
        ...

    @verb()
    def models(self) -> tuple[BackendInfo, ...]:
        """Every served model's description (``ringtune serve --model`` given more than once), the first one
        first: each has its own name and aliases, runs, LoRA base, samplers and memory budget (cheap)."""
        ...

    @verb()
    def health(self) -> BackendHealth:
        """Whether the backend can serve (cheap; may be called from the event loop)."""
        ...

    @verb("create_run", addressee="run_id", lifecycle="create")
    def create_run(self, run_id: str, base_model: str, lora: Mapping[str, Any] | None = None) -> None:
        """A fresh trainable copy of ``base_model`` (a served model's ``model_name`` or alias) under ``run_id``;
        with ``lora`` (a :class:`~ringtune.models.lora.LoraSpec` as a dict) a LoRA run on the shared frozen base."""
        ...

    @verb("free_run", addressee="run_id", lifecycle="free")
    def free_run(self, run_id: str) -> None:
        """Drop the run's weights, gradients and optimizer state; unknown ids are ignored."""
        ...

    @verb("forward_backward", addressee="run_id")
    def forward_backward(
        self,
        run_id: str,
        data: Sequence[TrainDatum],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Tinker forward(_backward): per-datum outputs (``logprobs``, ``elementwise_loss``, shaped like
        ``target_tokens``) and metrics (``name:reduction`` keys, ``loss:sum`` included). Gradients accumulate
        until :meth:`optim_step` unless ``forward_only``."""
        ...

    @verb("forward_backward_many", addressee="run_ids")
    def forward_backward_many(
        self,
        run_ids: Sequence[str],
        data: Sequence[Sequence[TrainDatum]],
        loss_fn: str,
        loss_config: Mapping[str, float] | None,
        forward_only: bool,
    ) -> list[tuple[list[dict[str, torch.Tensor]], dict[str, float]] | Exception]:
        """:meth:`forward_backward` of ``data[i]`` on LoRA run ``run_ids[i]`` for every i, in one pass over their
        shared base where possible (:mod:`ringtune.engine.lora_batch`): per run its (outputs, metrics), as
        alone, or the error its request got while the others still ran: a UserInputError (``user``) or
        another exception (``server``: a restored run's notice)."""
        ...

    @verb("optim_step", addressee="run_id")
    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW(``adam``) and clear them; returns metrics."""
        ...

    @verb("save_state", addressee="run_id")
    def save_state(self, run_id: str, path: str) -> None:
        """Write weights + optimizer state + step to the checkpoint directory ``path`` (atomically)."""
        ...

    @verb("load_state", addressee="run_id")
    def load_state(self, run_id: str, path: str, optimizer: bool) -> None:
        """Restore a :meth:`save_state` checkpoint; ``optimizer=False`` keeps the weights only (fresh moments).
        UserInputError (nothing changed) if ``path`` is missing or for another model."""
        ...

    @verb("export_hf", addressee="run_id")
    def export_for_sampler(self, run_id: str, path: str) -> None:
        """Write the run's current weights as an HF checkpoint directory ``path`` (atomically)."""
        ...

    @verb("create_sampler", addressee="sampler_id", lifecycle="create")
    def create_sampler(self, sampler_id: str, source: SamplerSource) -> None:
        """A sampling session on ``source`` (base model, an HF export directory, or a live run's current
        weights, snapshotted now); see :mod:`ringtune.sample.pool`."""
        ...

    @verb("free_sampler", addressee="sampler_id", lifecycle="free")
    def free_sampler(self, sampler_id: str) -> None:
        """Forget a sampling session; unknown ids are ignored."""
        ...

    @verb("sample", addressee="sampler_id")
    def sample(
        self,
        sampler_id: str,
        requests: Sequence[SampleRequest],
        *,
        job_id: str | None = None,
        slice_s: float | None = None,
    ) -> list[PromptSamples] | None:
        """Generate for every request (validated by the gateway) on the session's snapshot; one result each.

        ``slice_s`` None: to the end, in this call. Otherwise the call starts decode job ``job_id`` (unique
        among running jobs), decodes for about ``slice_s`` seconds and returns the results if it finished, else
        None: each :meth:`sample_more` continues it for another slice, and between slices the backend serves
        other verbs (a long generation does not hold the others back for its whole duration)."""
        ...

    @verb("sample_more")
    def sample_more(self, job_id: str, slice_s: float | None = None) -> list[PromptSamples] | None:
        """The next slice of a :meth:`sample` job: its results once it finished, else None. A job the backend
        lost (its worker ranks restarted) raises a server error."""
        ...

    @verb("probe")
    def probe(self, name: str) -> dict[str, Any]:
        """Run served probe ``name`` (:data:`ringtune.probes.ring_accumulation.SERVED_PROBES`) on the backend's
        own ranks, modes and dtype; its JSON-able summary. UserInputError for an unknown name."""
        ...

    @verb()
    def close(self) -> None:
        """Release everything (end of the server)."""
        ...


def served_info(models: Sequence[BackendInfo], base_model: str) -> BackendInfo:
    """The served model (of ``models``) named ``base_model`` by its name or an alias; UserInputError naming the
    served models otherwise."""
    for info in models:
        if base_model in (info.model_name, *info.aliases):
            return info
    names = [i.model_name for i in models]
    raise UserInputError(f"base_model={base_model!r} is not served here; this server serves {names}")


VERBS: dict[str, Verb] = verbs_of(Backend)
"""The one table of backend verbs (:mod:`ringtune.gateway.verbs`): name, signature, contract, worker command."""
