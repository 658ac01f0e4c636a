"""Sampling sessions and ``asample`` over the backend: validation, batching of concurrent requests, results.

- ``create_sampling_session`` (from the base model or a ``tinker://<run>/sampler_weights/<name>`` path) and the
  ephemeral session of an unnamed ``save_weights_for_sampler`` (a snapshot of the run's current weights)
  register a session on the backend (:mod:`ringtune.sample.pool`).
- ``asample`` validates the request on the event loop (a bad field is a JSON 400 naming it), answers at once
  with a ``request_id`` and one ``sample_sequence_ids`` entry per sample, and queues the request. One drain job
  on the backend thread takes every queued request, groups them by session and starts each group as one
  decode job (``backend.sample``: the backend spreads them over its ranks and batches equal settings
  together), then resolves each future with a protobuf ``SampleResponse``. Concurrent requests therefore share
  decode steps.
- A job decodes for ``slice_s`` seconds per turn: if it is not finished, its next turn (``backend.sample_more``)
  is queued under its own key of the backend thread's round-robin (:mod:`ringtune.gateway.scheduler`), so the
  other clients' ops and newer sampling requests run between its slices: a long generation delays a short
  request by about one slice, not by its whole length.
- Resubmits of a ``(sampling_session_id, seq_id)`` get the original ``request_id``.
- ``record_stability_info=true`` (a sampling client made for ``stable_reinforce``): each finished sequence is
  recorded under its ``sample_sequence_ids`` entry (:mod:`ringtune.gateway.stability_records`: prompt, tokens,
  the float32 log-probs the answer carries, MoE routing when the sampler records it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from tinker.proto import tinker_public_pb2 as pb

from ringtune.errors import UserInputError
from ringtune.gateway.backend import served_info
from ringtune.gateway.futures import FutureStore, Outcome
from ringtune.gateway.images import ImageDecoder, image_decoder
from ringtune.gateway.routing_records import RoutingRecords
from ringtune.gateway.sample_prompt import prompt_input
from ringtune.gateway.sample_targets import TargetLayout, encode_targets, parse_targets
from ringtune.gateway.stability_records import StabilityRecords
from ringtune.models.image_input import ImageInput
from ringtune.sample.alt_tokens import MAX_PROMPT_ALT_TOKENS_K
from ringtune.sample.params import DEFAULT_MAX_TOKENS, SamplingParams
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.request_checks import MAX_NUM_SAMPLES, MAX_TOPK_PROMPT_LOGPROBS, MAX_TOPK_SAMPLE_LOGPROBS
from ringtune.sample.sampler import PromptSamples

log = logging.getLogger(__name__)

DRAIN_KEY = "sampling"
"""The backend thread's queue key of the sampling drain (a job's later turns queue under ``sampling:<job>``)."""

SHUT_DOWN = "the server is shutting down; this sampling request was not finished"


class CreateSamplingSessionBody(BaseModel):
    """``create_sampling_session``: exactly one of ``base_model`` and ``model_path`` (a sampler export)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class SampleBody(BaseModel):
    """``asample`` as SDK 0.38 sends it (protocol section 6.7); values are checked by :func:`sample_request`."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: Any = 1
    prompt: dict[str, Any]
    sampling_params: dict[str, Any] = {}
    prompt_logprobs: Any = False
    topk_prompt_logprobs: Any = 0
    topk_sample_logprobs: Any = 0
    prompt_alt_tokens_k: Any = 0
    target_prompt_logprobs: Any = None
    prompt_logprobs_last_n: Any = None
    record_stability_info: Any = None


def _int(value: Any, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserInputError(f"{field}={value!r} must be an int in [{low}, {high}]")
    return value


def _bounded_params(params: dict[str, Any], prompt_len: int, context_length: int) -> dict[str, Any]:
    """The keyword arguments of :class:`SamplingParams`, with ``max_tokens`` bounded by the served context:
    prompt + max_tokens <= ``context_length`` (UserInputError naming both otherwise). A request that leaves
    ``max_tokens`` out gets ``min(DEFAULT_MAX_TOKENS, room left)``. ``max_tokens=1`` (``compute_logprobs``) is
    always allowed: its one token is drawn from the last prompt position and never enters the model."""
    kwargs = {k: v for k, v in params.items() if v is not None or k in ("seed", "stop")}
    room = context_length - prompt_len
    given = kwargs.get("max_tokens")
    if given is None:
        kwargs["max_tokens"] = max(1, min(DEFAULT_MAX_TOKENS, room))
    elif isinstance(given, int) and not isinstance(given, bool) and given > 1 and prompt_len + given > context_length:
        raise UserInputError(
            f"sampling_params.max_tokens={given} with a prompt of {prompt_len} tokens exceeds the served context "
            f"length {context_length} (prompt + max_tokens must be <= {context_length}: max_tokens <= {max(room, 1)})"
        )
    return kwargs


def sample_request(
    body: SampleBody,
    vocab_size: int,
    max_prompt_tokens: int,
    images: ImageDecoder | None = None,
    prompt: tuple[list[int], tuple[ImageInput, ...]] | None = None,
) -> tuple[SampleRequest, TargetLayout | None]:
    """A validated :class:`SampleRequest` and the layout of its ``target_prompt_logprobs`` (None without);
    UserInputError naming the field, the value and the limit. ``images``: the served checkpoint's image decoder
    (None: image chunks refused); a prompt's images count in its length (:mod:`ringtune.gateway.sample_prompt`).
    ``prompt``: ``prompt_input``'s answer for ``body.prompt`` when the caller already decoded it, else None."""
    if not isinstance(body.prompt_logprobs, bool):
        raise UserInputError(f"prompt_logprobs={body.prompt_logprobs!r} must be true or false")
    prompt, prompt_images = prompt if prompt is not None else prompt_input(body.prompt, vocab_size, images)
    if len(prompt) > max_prompt_tokens:
        raise UserInputError(f"prompt: {len(prompt)} tokens, over the limit of {max_prompt_tokens}")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not body.prompt_logprobs:
            raise UserInputError(f"prompt_logprobs_last_n={last_n!r} needs prompt_logprobs=true")
        last_n = _int(last_n, "prompt_logprobs_last_n", 1, max(1, len(prompt) - 1))
    targets, layout = None, None
    if body.target_prompt_logprobs is not None:
        targets, layout = parse_targets(body.target_prompt_logprobs, len(prompt), vocab_size)
    params = body.sampling_params
    if not isinstance(params, dict):
        raise UserInputError("sampling_params: expected an object")
    known = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise UserInputError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
    request = SampleRequest(
        prompt=prompt,
        images=prompt_images,
        params=SamplingParams(**_bounded_params(params, len(prompt), max_prompt_tokens)),
        num_samples=_int(body.num_samples, "num_samples", 1, MAX_NUM_SAMPLES),
        prompt_logprobs=body.prompt_logprobs,
        topk_prompt_logprobs=_int(body.topk_prompt_logprobs or 0, "topk_prompt_logprobs", 0, MAX_TOPK_PROMPT_LOGPROBS),
        topk_sample_logprobs=_int(body.topk_sample_logprobs or 0, "topk_sample_logprobs", 0, MAX_TOPK_SAMPLE_LOGPROBS),
        prompt_logprobs_last_n=last_n,
        target_tokens=targets,
        prompt_alt_tokens_k=_int(body.prompt_alt_tokens_k or 0, "prompt_alt_tokens_k", 0, MAX_PROMPT_ALT_TOKENS_K),
    )
    return request, layout


def _pack_topk(out: pb.TopkLogprobs, rows: list[list[tuple[int, float]] | None]) -> None:
    """Write ``rows`` (per position None or up to k ``(token, logprob)``) into ``out`` as the SDK reads it:
    row-major [length, k] int32 ids and float32 log-probs, short rows padded with (0, −99999.0)."""
    k = max((len(r) for r in rows if r), default=0)
    ids, lps = [], []
    for row in rows:
        row = list(row or [])
        row += [(0, -99999.0)] * (k - len(row))
        ids += [t for t, _ in row]
        lps += [lp for _, lp in row]
    out.token_ids = struct.pack(f"<{len(ids)}i", *ids)
    out.logprobs = struct.pack(f"<{len(lps)}f", *lps)
    out.k = k
    out.length = len(rows)


def encode_sample_response(
    result: PromptSamples, last_n: int | None = None, targets: TargetLayout | None = None
) -> bytes:
    """The protobuf ``SampleResponse`` of one request (tokens int32, log-probs float32, NaN where absent;
    each sequence's ``topk_sampled_logprobs`` when the request asked for ``topk_sample_logprobs``; the
    ``prompt_alt_tokens`` draws, int64 ids and float32 log-probs [len(prompt) − 1, k], when it asked for them).

    ``last_n`` (``prompt_logprobs_last_n``): only the last ``last_n`` prompt log-probs and top-k rows are
    reported; the entries before them are NaN / empty (None to the SDK), as the SDK checks. ``targets``:
    the request's ``target_prompt_logprobs`` layout, which the answer repeats.
    """
    out = pb.SampleResponse()
    for seq in result.sequences:
        s = out.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = struct.pack(f"<{len(seq.tokens)}i", *seq.tokens)
        s.logprobs = struct.pack(f"<{len(seq.logprobs)}f", *seq.logprobs)
        if seq.topk_logprobs is not None:
            _pack_topk(s.topk_sampled_logprobs, list(seq.topk_logprobs))
    if result.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in result.prompt_logprobs]
        if last_n is not None:
            values[: len(values) - last_n] = [math.nan] * (len(values) - last_n)
        out.prompt_logprobs = struct.pack(f"<{len(values)}f", *values)
    if result.topk_prompt_logprobs is not None:
        rows = list(result.topk_prompt_logprobs)
        if last_n is not None:
            rows[: len(rows) - last_n] = [None] * (len(rows) - last_n)
        _pack_topk(out.topk_prompt_logprobs, rows)
    if targets is not None and result.target_prompt_logprobs is not None:
        out.target_prompt_logprobs.CopyFrom(encode_targets(result.target_prompt_logprobs, targets))
    if result.prompt_alt_tokens is not None:
        ids, lps = result.prompt_alt_tokens
        shape = list(ids.shape)
        out.prompt_alt_tokens.tokens.CopyFrom(
            pb.Tensor(dense=ids.to(torch.int64).numpy().astype("<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=shape)
        )
        out.prompt_alt_tokens.logprobs.CopyFrom(
            pb.Tensor(dense=lps.to(torch.float32).numpy().astype("<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=shape)
        )
    return out.SerializeToString()


@dataclass
class SamplerSession:
    """A sampling session the gateway knows: its base model and, for a saved export, its tinker path."""

    sampler_id: str
    base_model: str
    model_path: str | None


class SamplingService:
    """The sampling half of the gateway (see the module docstring).

    Args:
        backend: the (observed) backend; called only from ``submit`` (the gateway's one backend thread).
        futures: the gateway's future store; ``call_on_loop`` runs a function on the event loop thread.
        submit: ``submit(key, fn)`` queues ``fn`` on the backend thread under ``key`` (a Future).
        max_prompt_tokens: the served context length (prompt + max_tokens).
        slice_s: decode time per turn of a job (0: each job runs to its end in one turn).
        routing: where the sampled sequences' MoE routing is recorded for replay (``--routing-replay``), or None.
        sampler: what answers the sampling verbs (``create_sampler``, ``free_sampler``, ``sample``,
            ``sample_more``): the backend itself (the built-in sampler), or an external engine's
            (:class:`~ringtune.gateway.vllm_sampling.VllmSampler`, ``serve --sampler vllm``).
        stability: where ``record_stability_info`` requests' sequences are recorded, or None (such a request is
            then refused).
    """

    def __init__(
        self,
        backend: Any,
        futures: FutureStore,
        submit: Callable[[str, Callable[[], None]], Future],
        call_on_loop: Callable[[Callable[[], None]], None],
        *,
        max_prompt_tokens: int,
        slice_s: float = 0.0,
        routing: RoutingRecords | None = None,
        sampler: Any = None,
        stability: StabilityRecords | None = None,
    ) -> None:
        self.backend, self.futures, self.submit, self.call_on_loop = backend, futures, submit, call_on_loop
        self.sampler = backend if sampler is None else sampler
        self.max_prompt_tokens, self.slice_s, self.routing = max_prompt_tokens, slice_s, routing
        self.stability = stability
        self._recorded: dict[str, list[str]] = {}  # request_id -> its sequence ids, while it records
        self.sessions: dict[str, SamplerSession] = {}
        self._seen: dict[tuple[str, int], dict[str, Any]] = {}
        self._pending: list[tuple[str, SampleRequest, str, TargetLayout | None]] = []
        self._lock = threading.Lock()
        self._drain_queued = False

    def register(self, sampler_id: str, base_model: str, model_path: str | None, source: SamplerSource) -> None:
        """Backend thread: create the session's snapshot, then (on the loop) make the session known."""
        self.sampler.create_sampler(sampler_id, source)
        session = SamplerSession(sampler_id, base_model, model_path)
        self.call_on_loop(lambda: self.sessions.__setitem__(sampler_id, session))

    def end_session(self, session_id: str) -> list[str]:
        """Loop thread: forget the sampling sessions a finished client session made and free them on the
        workers (backend thread; their snapshots stay until evicted, another session may share them).
        Returns the freed sampler ids. Requests already queued for them fail as unknown sessions."""
        prefix = f"{session_id}:sample:"
        freed = [sid for sid in self.sessions if sid.startswith(prefix)]
        for sid in freed:
            del self.sessions[sid]
        self._seen = {key: value for key, value in self._seen.items() if key[0] not in freed}
        if freed:
            self.submit(DRAIN_KEY, lambda: [self.sampler.free_sampler(sid) for sid in freed])
        return freed

    async def asample_decoding_images(self, body: SampleBody) -> dict[str, Any]:
        """Loop thread: :meth:`asample`, the prompt's images (if any) decoded first on a worker thread, since
        decoding and preprocessing a large image takes long enough to stall every other client on the loop."""
        chunks = body.prompt.get("chunks")
        if not isinstance(chunks, list) or not any(isinstance(c, dict) and c.get("type") == "image" for c in chunks):
            return self.asample(body)
        session = self.sessions.get(body.sampling_session_id or "")
        if session is None:  # refused by asample, naming the session
            return self.asample(body)
        info = served_info(self.backend.models(), session.base_model)
        prompt = await asyncio.to_thread(prompt_input, body.prompt, info.vocab_size, image_decoder(info))
        return self.asample(body, prompt)

    def asample(
        self, body: SampleBody, prompt: tuple[list[int], tuple[ImageInput, ...]] | None = None
    ) -> dict[str, Any]:
        """Validate and queue one request; ``{"request_id", "sample_sequence_ids"}`` at once. ``prompt``: the
        prompt already decoded (:meth:`asample_decoding_images`), or None to decode it here."""
        sampler_id = body.sampling_session_id
        if sampler_id is None or sampler_id not in self.sessions:
            raise UserInputError(
                f"sampling_session_id={sampler_id!r}: no such sampling session",
            )
        key = (sampler_id, body.seq_id) if isinstance(body.seq_id, int) else None
        if key is not None and key in self._seen:
            return self._seen[key]
        info = served_info(self.backend.models(), self.sessions[sampler_id].base_model)
        request, layout = sample_request(body, info.vocab_size, self.max_prompt_tokens, image_decoder(info), prompt)
        record = body.record_stability_info
        if record is not None and not isinstance(record, bool):
            raise UserInputError(f"record_stability_info={record!r} must be true or false")
        if record and self.stability is None:
            raise UserInputError("record_stability_info=true: this server keeps no stability records")
        request_id = self.futures.create("sample")
        answer = {
            "request_id": request_id,
            "sample_sequence_ids": [f"{request_id}:{i}" for i in range(request.num_samples)],
        }
        if record:
            self._recorded[request_id] = answer["sample_sequence_ids"]
        if key is not None:
            self._seen[key] = answer
        with self._lock:
            self._pending.append((sampler_id, request, request_id, layout))
            queue = not self._drain_queued
            self._drain_queued = True
        if queue:
            self._queue(DRAIN_KEY, self._drain, lambda: self._take_pending())
        return answer

    def _queue(self, key: str, fn: Callable[[], None], waiting: Callable[[], list[str]]) -> None:
        """``fn`` on the backend thread under ``key``; if the server is shutting down (the job is refused or
        cancelled before it ran), the requests ``waiting()`` names fail with a ``category: server`` error."""

        def fail() -> None:
            for request_id in waiting():
                self.call_on_loop(lambda rid=request_id: self.futures.resolve(rid, Outcome.error(SHUT_DOWN, "server")))

        try:
            future = self.submit(key, fn)
        except RuntimeError:  # the backend thread no longer takes jobs
            fail()
            return
        future.add_done_callback(lambda f: fail() if f.cancelled() else None)

    def _take_pending(self) -> list[str]:
        with self._lock:
            pending, self._pending = self._pending, []
            self._drain_queued = False
        return [request_id for _, _, request_id, _ in pending]

    def _drain(self) -> None:
        """Backend thread: start a decode job for every queued request, one per session (:meth:`_turn`)."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._drain_queued = False
        by_session: dict[str, list[tuple[SampleRequest, str, TargetLayout | None]]] = {}
        for sampler_id, request, request_id, layout in pending:
            by_session.setdefault(sampler_id, []).append((request, request_id, layout))
        for sampler_id, items in by_session.items():
            self._turn(f"sample-{uuid.uuid4().hex[:12]}", sampler_id, items, first=True)

    def _turn(
        self, job_id: str, sampler_id: str, items: list[tuple[SampleRequest, str, TargetLayout | None]], *, first: bool
    ) -> None:
        """Backend thread: one turn of job ``job_id`` (its start when ``first``); resolve its futures when it
        finished or failed, else queue its next turn under its own key."""
        slice_s = self.slice_s or None
        try:
            if first:
                results = self.sampler.sample(sampler_id, [r for r, _, _ in items], job_id=job_id, slice_s=slice_s)
            else:
                results = self.sampler.sample_more(job_id, slice_s)
            if results is None:
                more = lambda: self._turn(job_id, sampler_id, items, first=False)  # noqa: E731
                self._queue(f"{DRAIN_KEY}:{job_id}", more, lambda: [request_id for _, request_id, _ in items])
                return
            outcomes = [
                Outcome("proto", encode_sample_response(res, request.prompt_logprobs_last_n, layout))
                for res, (request, _, layout) in zip(results, items, strict=True)
            ]
            if self.routing is not None:
                for res, (request, _, _) in zip(results, items, strict=True):
                    for seq in res.sequences:  # image prompts: pad tokens do not identify the images
                        if seq.routing is not None and not request.images:
                            self.routing.add(request.prompt + seq.tokens[:-1], seq.routing)
            self._record(sampler_id, results, items)
        except UserInputError as exc:
            outcomes = [Outcome.error(str(exc), "user")] * len(items)
        except Exception as exc:
            log.exception("sampling on %s failed", sampler_id)
            outcomes = [Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server")] * len(items)
        for (_, request_id, _), outcome in zip(items, outcomes, strict=True):
            self._recorded.pop(request_id, None)
            self.call_on_loop(lambda rid=request_id, out=outcome: self.futures.resolve(rid, out))

    def _record(
        self, sampler_id: str, results: list[PromptSamples], items: list[tuple[SampleRequest, str, TargetLayout | None]]
    ) -> None:
        """Backend thread: record the sequences of the requests that asked (``record_stability_info``)."""
        for res, (request, request_id, _) in zip(results, items, strict=True):
            ids = self._recorded.get(request_id)
            if ids is None or self.stability is None:
                continue
            for sequence_id, seq in zip(ids, res.sequences, strict=True):
                self.stability.add(sampler_id, sequence_id, request.prompt, seq.tokens, seq.logprobs, seq.routing)


def new_sampler_id(session_id: str, seq: int) -> str:
    """A sampling session id: unique, and readable (``<session>:sample:<seq>:<random>``)."""
    return f"{session_id}:sample:{seq}:{uuid.uuid4().hex[:8]}"
