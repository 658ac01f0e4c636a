"""``generate``: prefill + batched token-by-token decoding of many sequences, with log-probs and stop rules.

The running sequences (rows) decode in a batch (:class:`~ringtune.sample.shared_decode.SharedDecode`, shared
with the other generations on the same base model when the caller passes a :class:`SharedDecodes`). While
there is room (``max_batch`` rows in that batch), waiting prompts are prefilled together as one packed row
(:func:`ringtune.sample.prefill.prefill`, the training forward at CP = 1), each prompt's ``num_samples``
sequences take their first token from the prompt's last logits and join the batch; then every step feeds each
row's newest token through :meth:`CausalLM.decode_hidden` (KV cache for attention layers, recurrent state and
conv window for GatedDeltaNet layers), chooses the next tokens, and rows that stopped leave the batch.

Log-probs: every sampled token comes with the model's own **untempered** log-prob,
``log_softmax(logits)[token]`` of the raw logits (float32, float64 for a float64 model), whatever the
temperature, top_k or top_p: the quantity the trainer's ``forward`` returns for that token, so an RL
importance ratio ``exp(trainer − sampler)`` is 1 up to numerics when the weights agree. With
``topk_sample_logprobs = k`` every generated position also reports the k largest entries of that same
``log_softmax(logits)`` (largest first): the sampled token's log-prob is bit-equal to its entry when listed.

With ``prompt_alt_tokens_k = k`` the prefill also draws k alternatives per prompt position from the model's
distribution at the request's temperature (:mod:`ringtune.sample.alt_tokens`; its own generator per prompt).

Randomness: sample j of a prompt draws one uniform per token from its own generator seeded by
``(seed, j)`` (``seed`` from the request, or fresh entropy per call and prompt): the same seed, prompt and
parameters give the same tokens whatever else is in the batch.

Arguments and results are plain Python values and dataclasses (picklable), so a gateway can send the call to
a worker: prompts as token lists, a :class:`SamplingParams`, results as :class:`PromptSamples`.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ringtune.models.decoder import CausalLM
from ringtune.models.image_input import ImageInput
from ringtune.models.layers.moe import capturing_routing, moe_shape
from ringtune.models.shard import shard_of
from ringtune.sample.alt_tokens import AltDraws, AltTokens
from ringtune.sample.choose import choose_tokens
from ringtune.sample.mesh_prompts import PromptForward
from ringtune.sample.params import DEFAULT_MAX_TOKENS, SamplingParams
from ringtune.sample.prefill import PrefillResult, prefill
from ringtune.sample.request_checks import check_request, check_targets
from ringtune.sample.results import PromptSamples, SampledSequence
from ringtune.sample.shared_decode import SharedDecode, SharedDecodes
from ringtune.sample.stopping import Decode, StopCondition, stop_condition, stop_reason

DEFAULT_MAX_BATCH = 64
"""Rows decoded together by default."""

RESERVE_TOKENS = 512
"""KV slots reserved per row up front (beyond the longest prompt); the cache grows past it when needed."""

DEFAULT_PREFILL_TOKENS = 16384
"""Prompt tokens packed into one prefill row by default (a longer prompt gets a row of its own)."""


@dataclass
class _Row:
    prompt: int
    sample: int
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]]] = field(default_factory=list)
    routing: list[torch.Tensor] | None = None  # [n, L, k] pieces: the prompt's, then one per token fed


def config_eos_token_ids(model: CausalLM) -> tuple[int, ...]:
    """The model config's ``eos_token_id`` (an int or a list; the text config's for a VL config), or ()."""
    hf = model.config.hf_config
    value = (hf.get("text_config") or {}).get("eos_token_id", hf.get("eos_token_id"))
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def sample_generator(seed: int, sample: int) -> torch.Generator:
    """The CPU generator of sample ``sample`` of a request seeded ``seed`` (a hash of both, 63 bits)."""
    digest = hashlib.sha256(f"ringtune-sample:{seed}:{sample}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class Generation:
    """One ``generate`` call's state: the waiting prompts, the running rows and their batch, the results.

    Resumable: :meth:`advance` decodes until a deadline and returns; the caller may do other work (other
    commands, other requests) and advance it again later. The rows, their caches and generators stay here
    between calls, so the tokens do not depend on how the decode was sliced.
    """

    def __init__(
        self,
        model: CausalLM,
        prompts: list[list[int]],
        params: SamplingParams,
        stop: StopCondition,
        *,
        num_samples: int,
        prompt_logprobs: bool,
        topk: int,
        sample_topk: int = 0,
        alt_k: int = 0,
        max_batch: int,
        prefill_tokens: int,
        prefilled: Sequence[PromptForward] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
        record_routing: bool = False,
        decodes: SharedDecodes | None = None,
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> None:
        self.model, self.prompts, self.params, self.stop = model, prompts, params, stop
        self.images = images  # per prompt, its images (VL models), or None
        # Routing records (R3) of a MoE model: prompts prefilled here and every decode step; a prompt prefilled
        # on the mesh has none (its routing ran on other ranks).
        self.record_routing = record_routing and moe_shape(model) is not None and prefilled is None
        self.prefilled, self.targets = prefilled, targets
        self.num_samples, self.want_lp, self.topk, self.sample_topk = num_samples, prompt_logprobs, topk, sample_topk
        self.max_batch, self.prefill_tokens, self.alt_k = max_batch, prefill_tokens, alt_k
        self.max_tokens: int = params.max_tokens or DEFAULT_MAX_TOKENS  # never None after validation
        weight = model.output_weight
        self.weight = weight if weight.dtype in (torch.float32, torch.float64) else weight.float()
        self.seeds = [params.seed if params.seed is not None else secrets.randbits(63) for _ in prompts]
        self.waiting = deque(range(len(prompts)))
        self.decodes = decodes if decodes is not None else SharedDecodes(enabled=False)
        self.decode: SharedDecode | None = None  # the batch this generation's rows decode in
        self.failure: BaseException | None = None
        self.done: list[list[SampledSequence | None]] = [[None] * num_samples for _ in prompts]
        self.prompt_lp: list[list[float | None] | None] = [None] * len(prompts)
        self.prompt_topk: list[list[list[tuple[int, float]] | None] | None] = [None] * len(prompts)
        self.target_lp: list[torch.Tensor | None] = [None] * len(prompts)
        self.alt: list[AltTokens | None] = [None] * len(prompts)

    @property
    def running(self) -> int:
        """Rows of this generation decoding now (in its shared batch)."""
        return self.decode.count(self) if self.decode is not None else 0

    @property
    def finished(self) -> bool:
        """Whether every prompt's samples are done (then :meth:`results` answers); never after a failure."""
        return self.failure is None and not self.waiting and not self.running

    def advance(self, deadline: float | None = None) -> bool:
        """Prefill and decode until every sequence stopped, or until ``time.monotonic()`` passes ``deadline``
        (checked after each step, so each call makes progress; None: to the end). Whether it is finished.

        A step decodes every row of the shared batch (:mod:`ringtune.sample.shared_decode`): other
        generations' rows advance too. Raises the error of a failed shared step, here or in another
        generation's call, and from then on."""
        with torch.inference_mode():
            while not self.finished:
                if self.failure is not None:
                    raise self.failure
                self._admit()
                if self.running:
                    self.decode.step()  # type: ignore[union-attr]
                if deadline is not None and time.monotonic() >= deadline:
                    break
        if self.failure is not None:
            raise self.failure
        return self.finished

    def fail(self, error: BaseException) -> None:
        """A shared step failed with ``error`` and dropped this generation's rows: it can no longer finish."""
        self.failure = error

    def close(self) -> None:
        """Take this generation's rows out of its shared batch (it is abandoned, e.g. its job failed)."""
        if self.decode is not None:
            self.decode.leave(self)
        self.waiting.clear()

    def results(self) -> list[PromptSamples]:
        """One :class:`PromptSamples` per prompt, in order (once :attr:`finished`)."""
        if not self.finished:
            raise RuntimeError("Generation.results() before the generation finished")
        return [
            PromptSamples(
                sequences=[s for s in self.done[i] if s is not None],
                prompt_logprobs=self.prompt_lp[i],
                topk_prompt_logprobs=self.prompt_topk[i],
                target_prompt_logprobs=self.target_lp[i],
                prompt_alt_tokens=self.alt[i],
            )
            for i in range(len(self.prompts))
        ]

    def _admit(self) -> None:
        """Prefill waiting prompts whose samples fit the free rows (at least one prompt if none run)."""
        if not self.waiting:
            return
        if not self.running:  # the batch its base decodes in now (another generation's, or a new one)
            self.decode = self.decodes.for_model(self.model)
        assert self.decode is not None
        busy, own = len(self.decode), self.running
        group: list[int] = []
        tokens = 0
        while self.waiting:
            i = self.waiting[0]
            fits_rows = busy + (len(group) + 1) * self.num_samples <= self.max_batch
            fits_tokens = tokens + len(self.prompts[i]) <= self.prefill_tokens
            if group and not (fits_rows and fits_tokens):
                break
            if not group and not fits_rows and own:  # with no rows of its own it always admits one prompt
                break
            group.append(self.waiting.popleft())
            tokens += len(self.prompts[i])
        if not group:
            return
        if self.record_routing:
            with capturing_routing(self.model) as captured:
                result = self._prefill(group)
            routing = torch.stack([layer[0] for layer in captured], dim=1).to(torch.int16).cpu()  # [row, L, k]
            starts = shard_of([len(self.prompts[i]) for i in group]).plan.local_starts
        else:
            result = self._prefill(group)
        rows, caches, logits = [], [], []
        for g, i in enumerate(group):
            if result.prompt_logprobs is not None:
                self.prompt_lp[i] = result.prompt_logprobs[g]
            if result.topk_prompt_logprobs is not None:
                self.prompt_topk[i] = result.topk_prompt_logprobs[g]
            if result.target_logprobs is not None:
                self.target_lp[i] = result.target_logprobs[g]
            if result.prompt_alt_tokens is not None:
                self.alt[i] = result.prompt_alt_tokens[g]
            for j in range(self.num_samples):
                rows.append(_Row(prompt=i, sample=j, generator=sample_generator(self.seeds[i], j)))
                if self.record_routing:
                    rows[-1].routing = [routing[starts[g] : starts[g] + len(self.prompts[i])]]
                caches.append(result.caches[g])
                logits.append(result.last_logits[g])
        alive = self.take(rows, torch.stack(logits))
        reserve = min(self.max_tokens, RESERVE_TOKENS)
        self.decode.join(self, [rows[r] for r in alive], [caches[r] for r in alive], reserve)

    def _prefill(self, group: list[int]) -> PrefillResult:
        """The prompts' prefill: run here as one packed row, or taken from ``prefilled`` (run on the mesh)."""
        if self.prefilled is None:
            prompts = [self.prompts[i] for i in group]
            targets = [self.targets[i] for i in group] if self.targets is not None else None
            alt = None
            if self.alt_k:
                alt = AltDraws(self.alt_k, self.params.temperature, tuple(self.seeds[i] for i in group))
            images = [self.images[i] for i in group] if self.images is not None else None
            return prefill(
                self.model,
                prompts,
                prompt_logprobs=self.want_lp,
                topk=self.topk,
                targets=targets,
                alt=alt,
                images=images,
            )
        done = [self.prefilled[i] for i in group]
        if self.max_tokens > 1 and any(f.cache is None for f in done):
            raise ValueError("prefilled prompts need their caches to decode more than one token")
        return PrefillResult(
            last_logits=torch.stack([f.last_logits for f in done]),
            caches=[f.cache for f in done],  # type: ignore[misc]
            prompt_logprobs=[f.prompt_logprobs for f in done] if self.want_lp else None,
            topk_prompt_logprobs=[f.topk_prompt_logprobs for f in done] if self.topk else None,
            target_logprobs=[f.target_logprobs for f in done] if self.targets is not None else None,  # type: ignore[misc]
            prompt_alt_tokens=[f.prompt_alt_tokens for f in done] if self.alt_k else None,  # type: ignore[misc]
        )

    def take(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Choose each row's next token from ``logits`` [B, V]; finish the rows that stop; return the others."""
        uniforms = None
        if not self.params.greedy:
            draws = [
                torch.rand((), generator=r.generator, dtype=torch.float64, device="cpu") for r in rows
            ]  # CPU generators
            uniforms = torch.stack(draws)
        chosen = choose_tokens(logits, self.params, uniforms)
        norm = torch.logsumexp(logits, dim=-1)
        lps = (logits.gather(1, chosen[:, None])[:, 0] - norm).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in rows]
        if self.sample_topk:  # the same subtraction as lps: a listed sampled token's entry is bit-equal
            values, ids = logits.topk(self.sample_topk, dim=-1)
            top_lps = (values - norm[:, None]).tolist()
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), top_lps, strict=True)]
        alive = []
        for b, (row, token, lp) in enumerate(zip(rows, chosen.tolist(), lps, strict=True)):
            row.tokens.append(token)
            row.logprobs.append(lp)
            if self.sample_topk:
                row.topk.append(tops[b])
            stopped = self.stop.check(row.tokens)
            if stopped or len(row.tokens) >= self.max_tokens:
                topk = row.topk if self.sample_topk else None
                routing = torch.cat(row.routing) if row.routing is not None else None
                self.done[row.prompt][row.sample] = SampledSequence(
                    row.tokens, row.logprobs, stop_reason(stopped), topk, routing
                )
            else:
                alive.append(b)
        return alive


def start_generation(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    num_samples: int = 1,
    prompt_logprobs: bool = False,
    topk_prompt_logprobs: int = 0,
    topk_sample_logprobs: int = 0,
    prompt_alt_tokens_k: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    decode: Decode | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
    prefilled: Sequence[PromptForward] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    record_routing: bool = False,
    decodes: SharedDecodes | None = None,
    images: Sequence[Sequence[ImageInput]] | None = None,
) -> Generation:
    """A :class:`Generation` of ``num_samples`` continuations of every prompt, checked and not yet run: the
    caller advances it (:meth:`Generation.advance`), in one go or in slices. Arguments: see :func:`generate`;
    ``decodes``: the rank's shared decode batches its rows join (None: a batch of its own); ``images``: per prompt,
    its images (a VL model: prefilled through the vision tower, decoded at its MRoPE positions), or None."""
    vocab = model.config.vocab_size
    checked = check_request(
        prompts, vocab, num_samples, topk_prompt_logprobs, max_batch, topk_sample_logprobs, prompt_alt_tokens_k
    )
    eos = eos_token_ids if eos_token_ids is not None else config_eos_token_ids(model)
    stop = stop_condition(params, eos_token_ids=eos, vocab_size=vocab, decode=decode)
    generation = Generation(
        model,
        checked,
        params,
        stop,
        num_samples=num_samples,
        prompt_logprobs=prompt_logprobs,
        topk=topk_prompt_logprobs,
        sample_topk=topk_sample_logprobs,
        alt_k=prompt_alt_tokens_k,
        max_batch=max_batch,
        prefill_tokens=prefill_tokens,
        prefilled=prefilled,
        targets=check_targets(targets, checked, vocab),
        record_routing=record_routing,
        decodes=decodes,
        images=images,
    )
    if images is not None and len(images) != len(checked):
        raise ValueError(f"images has {len(images)} entries for {len(checked)} prompts")
    if prefilled is not None and len(prefilled) != len(checked):
        raise ValueError(f"prefilled has {len(prefilled)} entries for {len(checked)} prompts")
    return generation


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    num_samples: int = 1,
    prompt_logprobs: bool = False,
    topk_prompt_logprobs: int = 0,
    topk_sample_logprobs: int = 0,
    prompt_alt_tokens_k: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    decode: Decode | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
    prefilled: Sequence[PromptForward] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    record_routing: bool = False,
    images: Sequence[Sequence[ImageInput]] | None = None,
) -> list[PromptSamples]:
    """Sample ``num_samples`` continuations of every prompt (see the module docstring).

    Args:
        model: a :class:`CausalLM` (single process, not FSDP-sharded); put in eval mode by the caller or not,
            it has no dropout. Runs under ``torch.inference_mode``.
        prompts: token id lists, each non-empty, ids in ``[0, vocab_size)``.
        params: :class:`SamplingParams` (validated when built).
        num_samples: sequences per prompt, in [1, MAX_NUM_SAMPLES].
        prompt_logprobs: also return ``log p(prompt[i] | prompt[:i])`` (entry 0 None), by the training head.
        topk_prompt_logprobs: also return the k most likely tokens and log-probs per prompt position (0: off).
        topk_sample_logprobs: also return, per generated token, the k most likely tokens and their untempered
            log-probs at that step (``SampledSequence.topk_logprobs``; 0: off).
        prompt_alt_tokens_k: also draw k alternatives per prompt position (``PromptSamples.prompt_alt_tokens``;
            0: off; :mod:`ringtune.sample.alt_tokens`), with the generator of the request's seed.
        eos_token_ids: what ``stop=None`` stops at (and a non-empty stop list too); default the config's EOS.
        decode: token ids -> text (a tokenizer's ``decode``), required when ``params.stop`` holds strings.
        max_batch: rows decoded together; a prompt's samples join together (one prompt may exceed it alone).
        prefill_tokens: prompt tokens packed into one prefill row.
        prefilled: prompt i's forward already ran elsewhere (the DP×CP forward of
            :mod:`ringtune.sample.mesh_prompts`): ``prefilled[i]`` gives its last logits, caches (needed when
            ``max_tokens > 1``) and prompt log-probs; decoding then continues exactly as after a prefill here.
        targets: per prompt an int64 [n−1, K] of token ids (Tinker's ``target_prompt_logprobs``, the same K
            for all; −1 = none): their log-probs come back as ``PromptSamples.target_prompt_logprobs``.
        images: per prompt, its images (a VL model; docs/vision.md), or None.
        record_routing: on a MoE model, record per sequence the experts every MoE layer chose for each token
            fed (``SampledSequence.routing``, for routing replay); prompts prefilled elsewhere have none.
    Returns:
        One :class:`PromptSamples` per prompt, in order. Raises UserInputError naming a bad field.
    """
    generation = start_generation(
        model,
        prompts,
        params,
        num_samples=num_samples,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk_prompt_logprobs,
        topk_sample_logprobs=topk_sample_logprobs,
        prompt_alt_tokens_k=prompt_alt_tokens_k,
        eos_token_ids=eos_token_ids,
        decode=decode,
        max_batch=max_batch,
        prefill_tokens=prefill_tokens,
        prefilled=prefilled,
        targets=targets,
        record_routing=record_routing,
        images=images,
    )
    generation.advance()
    return generation.results()
