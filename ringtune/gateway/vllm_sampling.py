"""Sampling sessions on a vLLM engine (``ringtune serve --sampler vllm``): the backend's sampling verbs
(``create_sampler``, ``free_sampler``, ``sample``, ``sample_more``) answered by an external engine.

:class:`~ringtune.gateway.sampling.SamplingService` calls these instead of the backend's when the server runs
``--sampler vllm``; everything else (training, checkpoints) stays on the backend.

**Which weights a session samples.** A session names its weights once, at creation:

- the base model: the engine's own model name;
- a sampler export with a PEFT adapter (a LoRA run's ``save_weights_for_sampler``) on an engine with LoRA:
  a runtime adapter (``/v1/load_lora_adapter``) on the shared base, named after the adapter's path and
  file time (many runs, one engine; a re-written export is a new adapter);
- any other export (full fine-tuning; a LoRA export on an engine without LoRA: its merged weights): a
  whole-weight reload of the engine from the directory (``reload_weights``, then the prefix cache reset);
- an unnamed ``save_weights_for_sampler`` (a run's current weights): exported now by the backend
  (``export_for_sampler``) to ``<scratch>/<sampler id>`` (deleted with the session), then as above;
- an inflight one (``SamplerSource.inflight``): the same export, published as the run's *inflight target*,
  which every inflight session of the run samples, earlier ones included (:mod:`ringtune.sample.pool`); a job
  keeps the target it started with. The run's inflight exports are deleted with its last inflight session.

**Which engine.** Several engines (``--vllm-engines N``, ``--vllm-url`` repeated; one set per served model)
form an :class:`~ringtune.gateway.vllm_engines.EngineSet`: a session is placed on one engine of its model when
it is created and sticks to it (placement rules there); its weights are loaded on that engine only.

An engine holds one set of base weights at a time: each job needs a **weight gate** (the base, or one
full-weights directory and version). Jobs of the gate its engine holds run together; a job of another gate
waits until no started job of the held gate on that engine has a completion in flight, then the engine
reloads. So a session always samples the weights it names, even when two snapshots of one run are sampled
alternately.

**What the engine cannot answer** (:func:`~ringtune.sample.engines.vllm_api.split_request`) is answered by
ringtune's own forward: a one-token request on a built-in sampling session of the same weights, made
lazily (the backend's ``create_sampler``) and freed with the session.

**MoE routing and stability records.** With ``record_routing`` (``--routing-replay`` on a MoE model) each
finished sequence gets its routing from ringtune's forward of its fed tokens on the job's weights (one prefill
per sequence on the training ranks, :mod:`ringtune.sample.engines.forward_routing`); the service then records it
for replay and in the stability records. Those records keep the engine's sampled log-probs, the ones the tokens
were drawn with and the client received (docs/sampling.md, "Stability records and MoE routing of engine
samples").

**Failures.** A completion that fails (engine down or restarting, a 5xx, a malformed answer) fails its job's
requests with a ``category: server`` error (SamplingService); other jobs, other engines' sessions and later
requests are unaffected once the engine's monitor restarted it (a session whose engine gave up moves to another
engine of its model); an engine restart (a new ``incarnation``) drops what was loaded, which
the next job loads again.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway.vllm_engines import BASE_GATE, Engines, EngineSet, EngineSlot
from ringtune.gateway.vllm_engines import SamplingEngine as SamplingEngine  # re-exported: its old home
from ringtune.sample.engines.forward_routing import routing_requests, with_routing
from ringtune.sample.engines.vllm_api import completion_body, merged_samples, prompt_samples, split_request
from ringtune.sample.pool import SampleRequest, SamplerSource
from ringtune.sample.sampler import PromptSamples

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


def _version(path: Path) -> str:
    """A short digest of ``path`` and its files' sizes and times: a re-written directory gets a new one."""
    stamp = [str(path.resolve())]
    stamp += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(path.iterdir()) if f.is_file()]
    return hashlib.sha256("|".join(stamp).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EngineWeights:
    """What a session samples on the engine: ``kind`` base / lora / full, the directory, and its version."""

    kind: str
    path: str | None = None
    version: str = ""

    @property
    def gate(self) -> str:
        """The base weights the engine must hold (:data:`BASE_GATE`, or a full-weights directory@version)."""
        return f"{self.path}@{self.version}" if self.kind == "full" else BASE_GATE

    @property
    def adapter_name(self) -> str:
        """The engine's model name of a LoRA session's adapter."""
        return f"ringtune-lora-{self.version}"


@dataclass
class _Session:
    weights: EngineWeights
    source: SamplerSource
    slot: EngineSlot  # the engine it sticks to (vllm_engines)
    scratch: Path | None = None  # an unnamed export this session owns
    forward_id: str | None = None  # its built-in session for what the engine cannot answer
    inflight_run: str | None = None  # samples that run's inflight target (its weights at the newest publish)

    @property
    def placement(self) -> str:
        """Its placement key on the engine set: ``inflight:<run>``, else its gate."""
        return f"inflight:{self.inflight_run}" if self.inflight_run is not None else self.weights.gate


@dataclass
class _InflightTarget:
    weights: EngineWeights
    exports: list[Path]  # every export published for the run; deleted with its last inflight session


@dataclass
class _Job:
    sampler_id: str
    requests: list[SampleRequest]
    engine_parts: list[SampleRequest]
    forward_results: list[PromptSamples | None]
    weights: EngineWeights
    slot: EngineSlot
    futures: list[Future] = field(default_factory=list)

    @property
    def gate(self) -> str:
        return self.weights.gate

    @property
    def in_flight(self) -> bool:
        return any(not f.done() for f in self.futures)


class VllmSampler:
    """The sampling verbs over ``engines`` (module docstring).

    Args:
        engines: the started (or attached) engine, or served model name -> its engines
            (:class:`~ringtune.gateway.vllm_engines.EngineSet`); all stopped by :meth:`close`.
        backend: the gateway's backend: exports of live runs and the built-in forward for what the engine cannot
            answer. Called only from the backend thread, as every method here is.
        scratch: where unnamed exports go (a filesystem the engine reads too).
        max_concurrent: completion calls in flight at once (the engine batches them).
        record_routing: every sampled sequence gets its MoE routing from ringtune's forward of its tokens
            (``--routing-replay``; module docstring).
    """

    def __init__(
        self, engines: Engines, backend: Any, scratch: Path, *, max_concurrent: int = 64, record_routing: bool = False
    ) -> None:
        self.engines, self.backend, self.scratch = EngineSet(engines), backend, scratch
        self.record_routing = record_routing
        self.pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="vllm-completion")
        self.sessions: dict[str, _Session] = {}
        self.jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.inflight: dict[str, _InflightTarget] = {}  # run id -> its inflight target

    @staticmethod
    def engine_prompt_logprobs(slot: EngineSlot) -> bool:
        """Whether ``slot``'s engine answers prompt log-probs (vLLM 0.32 crashes on them with ``--enable-lora``)."""
        return not slot.engine.config.enable_lora

    def weights_of(self, sampler_id: str, source: SamplerSource) -> tuple[EngineWeights, Path | None]:
        """The engine weights of ``source`` (on an engine of ``source.model``) and the scratch export it made
        (None unless a live run's)."""
        scratch = None
        path = source.path
        if source.run_id is not None:
            scratch = self.scratch / sampler_id.replace(":", "_")
            self.backend.export_for_sampler(source.run_id, str(scratch))
            path = str(scratch)
        if path is None:
            return EngineWeights("base"), None
        directory = Path(path)
        engine = self.engines.slots_of(source.model)[0].engine
        lora = engine.config.enable_lora and (directory / ADAPTER_CONFIG).is_file()
        return EngineWeights("lora" if lora else "full", str(directory), _version(directory)), scratch

    def create_sampler(self, sampler_id: str, source: SamplerSource) -> None:
        """A session on ``source``'s weights (the base, an HF export, a live run exported now)."""
        weights, scratch = self.weights_of(sampler_id, source)
        forward_source = SamplerSource(path=weights.path, model=source.model)
        inflight_run = source.run_id if source.inflight and source.run_id is not None and scratch is not None else None
        key = weights.gate if inflight_run is None else f"inflight:{inflight_run}"
        session = _Session(weights, forward_source, self.engines.place(source.model, key), scratch)
        if inflight_run is not None:
            assert scratch is not None
            target = self.inflight.setdefault(inflight_run, _InflightTarget(weights, []))
            target.weights = weights
            target.exports.append(scratch)
            session.scratch, session.inflight_run = None, inflight_run
        self.sessions[sampler_id] = session
        log.info(
            "vLLM sampling session %s on %s weights %s (engine %s)",
            sampler_id,
            weights.kind,
            weights.path or "(base)",
            session.slot.label,
        )

    def free_sampler(self, sampler_id: str) -> None:
        """Forget a session: its built-in forward session, its scratch export, its adapter when unused."""
        session = self.sessions.pop(sampler_id, None)
        if session is None:
            return
        if session.forward_id is not None:
            self.backend.free_sampler(session.forward_id)
        if session.scratch is not None:
            shutil.rmtree(session.scratch, ignore_errors=True)
        run = session.inflight_run
        if run is not None and not any(s.inflight_run == run for s in self.sessions.values()):
            for export in self.inflight.pop(run).exports:
                shutil.rmtree(export, ignore_errors=True)
        self.engines.release(session.slot, session.placement)
        name = session.weights.adapter_name
        users = [s for s in self.sessions.values() if s.slot is session.slot and s.weights.adapter_name == name]
        if session.weights.kind == "lora" and not users:
            self.engines.drop_adapter(session.slot, name)

    def weights_now(self, session: _Session) -> EngineWeights:
        """What a job of ``session`` samples: its weights, or its run's inflight target as published now."""
        return session.weights if session.inflight_run is None else self.inflight[session.inflight_run].weights

    def _forward(
        self, sampler_id: str, session: _Session, weights: EngineWeights, requests: list[SampleRequest]
    ) -> list[PromptSamples]:
        """ringtune's own forward (one-token requests) on ``weights``, on the session's lazily made built-in
        session (made anew when the weights differ from the ones it was made on)."""
        source = SamplerSource(path=weights.path, model=session.source.model)
        if session.forward_id is not None and source != session.source:  # an inflight target was republished
            self.backend.free_sampler(session.forward_id)
            session.forward_id = None
        if session.forward_id is None:
            session.forward_id, session.source = f"{sampler_id}:forward:{uuid.uuid4().hex[:8]}", source
            self.backend.create_sampler(session.forward_id, source)
        results = self.backend.sample(session.forward_id, requests)
        assert results is not None  # slice_s None: to the end
        return results

    def sample(
        self,
        sampler_id: str,
        requests: Sequence[SampleRequest],
        *,
        job_id: str | None = None,
        slice_s: float | None = None,
    ) -> list[PromptSamples] | None:
        """Start a job: the forward's part now, the engine's completions in flight; the results when they
        finished within ``slice_s`` (None: wait for them), else None (:meth:`sample_more` continues)."""
        session = self.sessions.get(sampler_id)
        if session is None:
            raise UserInputError(f"sampling_session_id={sampler_id!r}: no such sampling session")
        session.slot = self.engines.replace_if_gone(session.slot, session.placement)
        from_engine = self.engine_prompt_logprobs(session.slot)
        parts = [split_request(r, engine_prompt_logprobs=from_engine) for r in requests]
        forward_asks = [(i, f) for i, (_, f) in enumerate(parts) if f is not None]
        forward_results: list[PromptSamples | None] = [None] * len(requests)
        if forward_asks:
            answers = self._forward(sampler_id, session, self.weights_now(session), [f for _, f in forward_asks])
            for (i, _), answer in zip(forward_asks, answers, strict=True):
                forward_results[i] = answer
        weights = self.weights_now(session)
        job = _Job(sampler_id, list(requests), [e for e, _ in parts], forward_results, weights, session.slot)
        key = job_id or f"vllm-{id(job)}"
        self.jobs[key] = job
        return self._advance(key, slice_s)

    def sample_more(self, job_id: str, slice_s: float | None = None) -> list[PromptSamples] | None:
        """The next turn of a job: its results once its completions finished, else None."""
        if job_id not in self.jobs:
            raise RuntimeError(f"sampling job {job_id!r} is unknown to the vLLM sampler")
        return self._advance(job_id, slice_s)

    def _advance(self, job_id: str, slice_s: float | None) -> list[PromptSamples] | None:
        job = self.jobs[job_id]
        try:
            if not job.futures and not self._start(job, slice_s):
                return None
            _, pending = wait(job.futures, timeout=slice_s)
            if pending:
                return None
            answers = [f.result() for f in job.futures]
        except BaseException:
            self.jobs.pop(job_id, None)
            raise
        self.jobs.pop(job_id, None)
        results = [
            merged_samples(prompt_samples(answer, part), forward)
            for answer, part, forward in zip(answers, job.engine_parts, job.forward_results, strict=True)
        ]
        return self._routed(job, results) if self.record_routing else results

    def _routed(self, job: _Job, results: list[PromptSamples]) -> list[PromptSamples]:
        """``results`` with each sequence's MoE routing from ringtune's forward of its fed tokens on the job's
        weights (:mod:`ringtune.sample.engines.forward_routing`); unchanged when the session ended meanwhile
        (replay is an optimisation: its tokens then keep the router's own choice in training)."""
        session = self.sessions.get(job.sampler_id)
        asks = routing_requests(job.requests, results)
        if session is None or not asks:
            return results
        return with_routing(job.requests, results, self._forward(job.sampler_id, session, job.weights, asks))

    def _start(self, job: _Job, slice_s: float | None) -> bool:
        """Put the job's completions in flight once its engine holds its gate (reloading when no started job of
        the held gate is in flight on that engine); False when it must wait (after waiting up to ``slice_s``)."""
        slot = job.slot
        while True:
            held = [other for other in self.jobs.values() if other.slot is slot and other.gate == slot.held_gate]
            busy = [f for other in held for f in other.futures if not f.done()]
            if job.gate == slot.held_gate or not busy:
                break
            _, still = wait(busy, timeout=slice_s, return_when=FIRST_COMPLETED)
            if slice_s is not None and still:
                return False
        if job.sampler_id not in self.sessions:
            raise UserInputError(f"sampling_session_id={job.sampler_id!r}: the session ended before it was sampled")
        weights = job.weights
        adapter = (weights.adapter_name, str(weights.path)) if weights.kind == "lora" else None
        model = self.engines.prepare(slot, weights.gate, weights.path, adapter)
        job.futures = [
            self.pool.submit(slot.engine.post, "/v1/completions", completion_body(part, model))
            for part in job.engine_parts
        ]
        return True

    def close(self) -> None:
        """Stop the completion threads and every engine (idempotent)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engines.stop()
