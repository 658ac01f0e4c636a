"""Sampler snapshots on one rank: which weights each sampling session samples from, within a memory limit.

A sampling session samples from one of three sources (:class:`SamplerSource`): the served base model, an HF
checkpoint directory (a named ``save_weights_for_sampler`` export), or the current weights of a live training
run (an ephemeral ``save_weights_and_get_sampling_client``). A **snapshot** is an inference copy of those
weights in memory. Snapshots are shared: two sessions on the same source share one, and a run's weights are
copied again only when they changed since its last snapshot (``Trainer.weights_version``). At most
``max_snapshots`` snapshots are held; the least recently used one that no newer session needs is evicted
first. A session whose snapshot was evicted reloads it if its source is on disk (base model, HF directory);
an evicted run snapshot is gone (the run moved on): sampling it is a user error asking for a new session.

**Inflight** sessions (``save_weights_for_sampler(kind="inflight")``) of a run share one snapshot, the run's
*inflight target* (key ``("inflight", run_id)``): each inflight create publishes the run's current weights to it
(a new snapshot replaces the old one, only if the weights changed since the last publish), and every inflight
session of the run, earlier ones included, samples from it. A run thus holds at most one inflight target, however
many inflight saves and sessions it has; a generation already running keeps the snapshot it started on.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ringtune.engine.snapshot import DEFAULT_MAX_SNAPSHOTS, snapshot_of
from ringtune.errors import UserInputError
from ringtune.models.decoder import CausalLM
from ringtune.models.image_input import ImageInput
from ringtune.models.lora_snapshot import LoraSnapshot
from ringtune.models.precision import compute_like_trainer
from ringtune.sample.mesh_prompts import PromptForward
from ringtune.sample.params import SamplingParams
from ringtune.sample.sampler import Generation, PromptSamples, start_generation
from ringtune.sample.shared_decode import SharedDecodes

DEFAULT_MAX_ADAPTER_SNAPSHOTS = 64
"""LoRA adapter snapshots (on the shared base) held per rank by default."""


@dataclass(frozen=True)
class SamplerSource:
    """Where a sampling session's weights come from: ``path`` (an HF directory), ``run_id`` (a live run's
    current weights), or neither (the served base model). ``inflight`` (with ``run_id``): the run's shared
    inflight target, republished with the run's current weights by this create (module docstring). ``model``: the
    name of the served base model it belongs to (several served models: :mod:`ringtune.worker.served_models`;
    None: the run's model, else the first)."""

    path: str | None = None
    run_id: str | None = None
    inflight: bool = False
    model: str | None = None


@dataclass(frozen=True, kw_only=True)
class SampleRequest:
    """One ``asample`` call: a prompt, how to sample, how many, and which prompt and top-k log-probs to return."""

    prompt: list[int]
    params: SamplingParams
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0  # per generated token, the k most likely tokens and log-probs (0: off)
    prompt_logprobs_last_n: int | None = None  # only the last n prompt log-probs are reported (the gateway's mask)
    target_tokens: torch.Tensor | None = None  # int64 [len(prompt) − 1, K]: ids whose prompt log-probs to return
    prompt_alt_tokens_k: int = 0  # draws per prompt position from the model's distribution (0: off)
    images: tuple[ImageInput, ...] = ()  # the prompt's images (VL models; their pad tokens are in ``prompt``)

    def with_fixed_seed(self) -> SampleRequest:
        """This request, its seed drawn now when it has none and it asks for prompt alt tokens.

        A long prompt's alt-token draws are made on the ranks that hold its rows (:mod:`ringtune.sample.mesh_prompts`),
        each reading its rows of the uniforms of the request's seed, so every rank must see the same seed: the
        backend fixes it before the command is replicated. Other requests keep ``seed=None`` (decoding draws on
        one rank).
        """
        if not self.prompt_alt_tokens_k or self.params.seed is not None:
            return self
        return replace(self, params=replace(self.params, seed=secrets.randbits(63)))

    @property
    def target_k(self) -> int:
        """K of ``target_tokens`` (0 without): requests prefilled together share it."""
        return 0 if self.target_tokens is None else int(self.target_tokens.shape[-1])


class SamplerPool:
    """This rank's snapshots and sampling sessions (the same on every rank: commands are replicated).

    Args:
        load: loads a model from a source path (``None`` = the base model), e.g. ``load_model``.
        decode: token ids -> text, for stop strings (the served tokenizer), or None.
        max_snapshots: weight copies held at once (base model, HF directories, full fine-tuning runs).
        max_adapter_snapshots: LoRA runs' adapter snapshots held at once (:mod:`ringtune.models.lora_snapshot`:
            adapters on the shared base, a few MiB each; they do not count against ``max_snapshots``).
        compute_dtype: the trainers' layer compute dtype under mixed precision (None: unmixed); loaded models
            compute in it as run snapshots do (:func:`~ringtune.models.precision.compute_like_trainer`).
        exact: the trainers' layers use exact arithmetic (``bf16-exact``); loaded models do too.
        record_routing: sequences sampled from a MoE snapshot carry their routing (routing replay).
        shared_decode: the rows of every generation on one base model decode in one batch
            (:mod:`ringtune.sample.shared_decode`: across requests, sessions and LoRA adapters); False: each
            settings group of a request decodes in a batch of its own.
    """

    def __init__(
        self,
        load: Callable[[str | None], CausalLM],
        *,
        decode: Callable[[list[int]], str] | None = None,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        max_adapter_snapshots: int = DEFAULT_MAX_ADAPTER_SNAPSHOTS,
        compute_dtype: torch.dtype | None = None,
        exact: bool = False,
        record_routing: bool = False,
        shared_decode: bool = True,
    ) -> None:
        if max_snapshots < 1:
            raise UserInputError(f"max_snapshots={max_snapshots} must be >= 1")
        self.decode, self.max_snapshots, self.record_routing = decode, max_snapshots, record_routing
        self.max_adapter_snapshots = max_adapter_snapshots
        self.decodes = SharedDecodes(enabled=shared_decode)
        self.load = lambda path: compute_like_trainer(load(path), compute_dtype, exact=exact)
        self.snapshots: OrderedDict[tuple, CausalLM] = OrderedDict()  # key -> model, least recently used first
        self.sessions: dict[str, tuple[tuple, SamplerSource]] = {}
        self.inflight_versions: dict[str, int] = {}  # run id -> weights_version its inflight target holds

    def _key(self, source: SamplerSource, trainers: Mapping[str, object]) -> tuple:
        if source.run_id is not None:
            trainer = trainers.get(source.run_id)
            if trainer is None:
                raise UserInputError(f"run {source.run_id!r} is not live; save sampler weights by name instead")
            if source.inflight:
                return ("inflight", source.run_id)
            return ("run", source.run_id, trainer.weights_version)  # type: ignore[attr-defined]
        return ("path", source.path)

    def _hold(self, key: tuple, make: Callable[[], CausalLM], *, adapters: bool = False) -> CausalLM:
        """The snapshot under ``key``, made now if not held; ``adapters``: it is a LoRA run's adapter snapshot
        (counted against ``max_adapter_snapshots``, not against the weight copies' ``max_snapshots``)."""
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return self.snapshots[key]
        limit = self.max_adapter_snapshots if adapters else self.max_snapshots
        while sum(self._is_adapters(k) == adapters for k in self.snapshots) >= limit:
            del self.snapshots[next(k for k in self.snapshots if self._is_adapters(k) == adapters)]
        model = make()
        self.snapshots[key] = model
        return model

    def _is_adapters(self, key: tuple) -> bool:
        return isinstance(self.snapshots.get(key), LoraSnapshot)

    def create(self, sampler_id: str, source: SamplerSource, trainers: Mapping[str, object]) -> None:
        """Register session ``sampler_id`` on ``source`` and hold its snapshot (copied or loaded once)."""
        key = self._key(source, trainers)
        if source.run_id is not None:
            trainer = trainers[source.run_id]  # a LoRA run's snapshot: its adapters on the shared base
            make = getattr(trainer, "sampler_snapshot", None)
            if source.inflight and self.inflight_versions.get(source.run_id) != trainer.weights_version:  # type: ignore[attr-defined]
                self.snapshots.pop(key, None)  # publish: the run's inflight sessions move to the new snapshot
                self.inflight_versions[source.run_id] = trainer.weights_version  # type: ignore[attr-defined]
            self._hold(key, make or (lambda: snapshot_of(trainer.model)), adapters=make is not None)  # type: ignore[attr-defined]
        else:
            self._hold(key, lambda: self.load(source.path))
        self.sessions[sampler_id] = (key, source)

    def free(self, sampler_id: str) -> None:
        """Forget a session (its snapshot stays until evicted: another session may share it)."""
        self.sessions.pop(sampler_id, None)

    def model(self, sampler_id: str) -> CausalLM:
        """The snapshot of session ``sampler_id``, reloaded from disk if it was evicted and can be."""
        entry = self.sessions.get(sampler_id)
        if entry is None:
            raise UserInputError(f"sampling_session_id={sampler_id!r}: no such sampling session")
        key, source = entry
        if key not in self.snapshots and source.run_id is not None:
            raise UserInputError(
                f"sampling_session_id={sampler_id!r}: its snapshot of run {source.run_id!r} was evicted (at most "
                f"{self.max_snapshots} are held); save the weights for a new sampling client"
            )
        return self._hold(key, lambda: self.load(source.path))

    def begin(
        self,
        sampler_id: str,
        requests: Sequence[SampleRequest],
        *,
        prefilled: Sequence[PromptForward | None] | None = None,
    ) -> PoolGeneration:
        """``requests`` on the session's snapshot as a :class:`PoolGeneration`, not yet run (checked now).

        Requests with equal sampling settings are generated together (one :class:`Generation`); every
        generation's rows decode in the shared batch of the snapshot's base (``shared_decode``).
        ``prefilled[i]``: request i's prompt already ran through the mesh forward (its logits, caches and
        prompt log-probs; :mod:`ringtune.sample.mesh_prompts`), or None to prefill it here. The generation
        holds the snapshot: evicting it or freeing the session meanwhile does not stop the generation.
        """
        model = self.model(sampler_id)
        forwards = list(prefilled) if prefilled is not None else [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            key = (
                r.params,
                r.num_samples,
                r.prompt_logprobs,
                r.topk_prompt_logprobs,
                r.topk_sample_logprobs,
                r.target_k,
                r.prompt_alt_tokens_k,
                forwards[i] is not None,
            )
            groups.setdefault(key, []).append(i)
        parts = []
        for (params, num_samples, prompt_lp, topk, sample_topk, target_k, alt_k, ran), members in groups.items():
            generation = start_generation(
                model,
                [requests[i].prompt for i in members],
                params,
                num_samples=num_samples,
                prompt_logprobs=prompt_lp,
                topk_prompt_logprobs=topk,
                topk_sample_logprobs=sample_topk,
                prompt_alt_tokens_k=alt_k,
                decode=self.decode,
                prefilled=[forwards[i] for i in members] if ran else None,  # type: ignore[misc]
                targets=[requests[i].target_tokens for i in members] if target_k else None,  # type: ignore[misc]
                record_routing=self.record_routing,
                decodes=self.decodes,
                images=[requests[i].images for i in members] if any(requests[i].images for i in members) else None,
            )
            parts.append((members, generation))
        return PoolGeneration(len(requests), parts)

    def sample(
        self,
        sampler_id: str,
        requests: Sequence[SampleRequest],
        *,
        prefilled: Sequence[PromptForward | None] | None = None,
    ) -> list[PromptSamples]:
        """Run ``requests`` to the end (:meth:`begin`, then advance without a deadline); one
        :class:`PromptSamples` per request, in order."""
        generation = self.begin(sampler_id, requests, prefilled=prefilled)
        generation.advance()
        return generation.results()


class PoolGeneration:
    """The :class:`~ringtune.sample.sampler.Generation` of each settings group of one :meth:`SamplerPool.begin`
    call, advanced together; results in request order."""

    def __init__(self, count: int, parts: list[tuple[list[int], Generation]]) -> None:
        self.count, self.parts = count, parts

    @property
    def finished(self) -> bool:
        return all(generation.finished for _, generation in self.parts)

    def advance(self, deadline: float | None = None) -> bool:
        """Advance each unfinished group in turn until ``deadline`` (``time.monotonic()``; each unfinished
        group makes at least one step per call; None: to the end). Whether all are finished."""
        for _, generation in self.parts:
            if not generation.finished:
                generation.advance(deadline)
        return self.finished

    def close(self) -> None:
        """Abandon the generation: its rows leave the shared decode batch (:meth:`Generation.close`)."""
        for _, generation in self.parts:
            generation.close()

    def results(self) -> list[PromptSamples]:
        """One :class:`PromptSamples` per request, in request order (once :attr:`finished`)."""
        out: list[PromptSamples | None] = [None] * self.count
        for members, generation in self.parts:
            for i, result in zip(members, generation.results(), strict=True):
                out[i] = result
        return [o for o in out if o is not None]


def tokenizer_decoder(tokenizer_dir: str | None) -> Callable[[list[int]], str] | None:
    """``decode(ids) -> text`` from ``<tokenizer_dir>/tokenizer.json`` (the tokenizers library), or None."""
    if tokenizer_dir is None:
        return None
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
