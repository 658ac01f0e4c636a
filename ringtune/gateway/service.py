"""The gateway's service without HTTP: the pieces that turn Tinker requests into backend jobs, wired together.

Each piece is one idea, in its own module:

- :class:`~ringtune.gateway.dispatch.Dispatcher`: per-run ``seq_id`` order, jobs on the one backend thread,
  futures resolved on the event loop, the SIGTERM drain;
- :class:`~ringtune.gateway.runs.RunBook`: sessions and runs (lookup, admission, freeing, housekeeping);
- :class:`~ringtune.gateway.run_creation.RunCreation`: ``create_model`` and create-via-load;
- :class:`~ringtune.gateway.training_ops.TrainingOps`: ``forward_backward`` / ``forward``, ``optim_step``;
- :class:`~ringtune.gateway.checkpoint_ops.CheckpointOps`: ``save_weights*`` and ``load_weights``;
- :class:`~ringtune.gateway.sampling.SamplingService` and :mod:`ringtune.gateway.sampling_sessions`: sampling;
- :class:`~ringtune.gateway.checkpoint_admin.CheckpointAdmin`: checkpoint TTL, publish, ``copy_weights``;
  :class:`~ringtune.gateway.checkpoint_reaper.CheckpointReaper`: expired checkpoints deleted;
- :class:`~ringtune.gateway.autosave.Autosaver` and :func:`~ringtune.gateway.restore.restore_live_runs`.

Threading: every method runs on the event loop thread (state needs no locks) except :meth:`GatewayService.drain`
and :meth:`GatewayService.close`. Errors: a request the gateway cannot even address raises
:class:`~ringtune.gateway.refusal.RefusedError` (a JSON 4xx); anything wrong with a request's content fails its
future with ``category: user``; any other exception fails it with ``category: server``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ringtune.gateway.autosave import Autosaver
from ringtune.gateway.backend import Backend
from ringtune.gateway.checkpoint_admin import CheckpointAdmin
from ringtune.gateway.checkpoint_ops import CheckpointOps
from ringtune.gateway.checkpoint_reaper import CheckpointReaper
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.dispatch import Dispatcher
from ringtune.gateway.downloads import DownloadSigner
from ringtune.gateway.futures import FutureStore, Outcome
from ringtune.gateway.images import image_decoder
from ringtune.gateway.observe import ObservedBackend
from ringtune.gateway.paths import CheckpointPaths
from ringtune.gateway.refusal import RefusedError
from ringtune.gateway.restore import restore_live_runs
from ringtune.gateway.routing_records import RoutingRecords
from ringtune.gateway.run_creation import RunCreation
from ringtune.gateway.runs import RunBook
from ringtune.gateway.sampling import CreateSamplingSessionBody, SamplingService
from ringtune.gateway.sampling_sessions import create_sampling_session
from ringtune.gateway.scheduler import FairExecutor
from ringtune.gateway.stability_records import DIRECTORY_NAME as STABILITY_DIRECTORY
from ringtune.gateway.stability_records import StabilityRecords
from ringtune.gateway.state import Registry
from ringtune.gateway.training_ops import TrainingOps
from ringtune.gateway.vllm_engines import Engines
from ringtune.gateway.vllm_sampling import VllmSampler
from ringtune.probes.ring_accumulation import SERVED_PROBES


class GatewayService:
    """Sessions, training runs and their ops over a :class:`Backend` (see the module docstring).

    Attributes (the routes call the pieces directly): ``runs``, ``creation``, ``training``, ``checkpoints``,
    ``sampling``, ``dispatcher``, ``admin`` (checkpoint TTL / publish / copy), ``reaper`` (expired checkpoints);
    and what they share: ``backend`` (observed), ``config``, ``paths``, ``registry``,
    ``futures``, ``executor`` (the backend thread; tools may run work on it), ``autosave``, ``downloads``
    (signed URLs of external weights, a new secret per server start), ``routing`` (sampled sequences' MoE routing,
    replayed for matching training datums: ``--routing-replay``; else None), ``restored`` (the runs brought back
    at start-up by ``--restore-live-runs``), ``engine_sampler`` (``sampling_engine`` given, ``serve --sampler vllm``:
    the :class:`~ringtune.gateway.vllm_sampling.VllmSampler` that answers sampling on that engine or on each served
    model's engines; closed with the service).
    replayed for matching training datums: ``--routing-replay``; else None), ``stability`` (what the sampler
    recorded for ``record_stability_info`` samples, persisted under the checkpoint root), ``restored`` (the runs
    brought back at start-up by ``--restore-live-runs``).
    """

    def __init__(self, backend: Backend, config: GatewayConfig, *, sampling_engine: Engines | None = None) -> None:
        config.validate()
        self.backend, self.config = ObservedBackend(backend, config.checkpoint_root), config
        self.paths = CheckpointPaths(config.checkpoint_root)
        self.registry = Registry(self.paths)
        self.autosave = Autosaver(config, self.paths, self.backend, self.registry.save)
        self.futures = FutureStore(
            max_done=config.max_done_futures,
            max_age_s=config.future_max_age_s,
            retrieved_keep_s=config.retrieved_keep_s,
        )
        self.executor = FairExecutor("ringtune-backend", max_join=config.lora_pass_runs)
        self.dispatcher = Dispatcher(self.futures, self.executor)
        self.downloads = DownloadSigner()
        image_decoder(backend.info())  # loaded now (seconds), not by the first image request on the event loop
        self.routing = RoutingRecords() if config.routing_replay else None
        self.engine_sampler = None  # ``serve --sampler vllm``: sampling sessions on the external engine
        if sampling_engine is not None:
            scratch = Path(config.checkpoint_root) / ".vllm" / "snapshots"
            self.engine_sampler = VllmSampler(
                sampling_engine, self.backend, scratch, record_routing=config.routing_replay
            )
        self.stability = StabilityRecords(Path(config.checkpoint_root) / STABILITY_DIRECTORY)
        self.sampling = SamplingService(
            self.backend,
            self.futures,
            submit=self.executor.submit_for,
            call_on_loop=self.dispatcher.loop_call,
            max_prompt_tokens=backend.info().context_length,
            slice_s=config.sample_slice_s,
            routing=self.routing,
            sampler=self.engine_sampler,
            stability=self.stability,
        )
        self.runs = RunBook(config, self.backend, self.registry, self.paths, self.dispatcher, self.sampling)
        self.creation = RunCreation(self.runs, self.backend, self.dispatcher, self.autosave)
        self.training = TrainingOps(
            self.runs, self.backend, self.dispatcher, self.autosave, self.routing, self.stability
        )
        self.checkpoints = CheckpointOps(
            self.runs, self.backend, self.paths, self.dispatcher, self.autosave, self.sampling, self.creation
        )
        self.admin = CheckpointAdmin(self.runs, self.paths)
        self.reaper = CheckpointReaper(
            self.registry,
            self.paths,
            lambda: [s.model_path for s in self.sampling.sessions.values()],
            every_s=config.reap_every_s,
        )
        self.restored = []
        if config.restore_live_runs:
            self.restored = restore_live_runs(self.registry, self.backend, self.paths)
            for run in self.restored:  # its first op answers the notice; its autosave clock starts now
                self.dispatcher.notices[run.run_id] = run.notice
                self.autosave.saved(run.run_id)
        else:
            self.registry.take_saved_sessions(restore=False)

    async def create_sampling_session(self, body: CreateSamplingSessionBody) -> dict[str, Any]:
        """See :func:`ringtune.gateway.sampling_sessions.create_sampling_session`."""
        return await create_sampling_session(body, self.runs, self.paths, self.sampling, self.dispatcher)

    async def probe(self, name: str) -> dict[str, Any]:
        """A served probe (:data:`~ringtune.probes.ring_accumulation.SERVED_PROBES`) on the backend's ranks, queued
        on the backend thread like any op; its summary. RefusedError 400 for an unknown name."""
        if name not in SERVED_PROBES:
            raise RefusedError(400, f"name={name!r} is not a served probe; choose one of {list(SERVED_PROBES)}")
        return await self.dispatcher.on_backend(lambda: self.backend.probe(name))

    async def retrieve(self, request_id: str) -> Outcome:
        """The outcome, or a ``try_again`` after the long-poll; RefusedError 404 for an unknown request_id."""
        try:
            outcome = await self.futures.wait(request_id, self.config.poll_timeout_s)
        except KeyError:
            raise RefusedError(
                404, f"request_id={request_id!r}: unknown (never issued, or dropped after retrieval / expiry)"
            ) from None
        if outcome is None:
            return Outcome("json", {"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return outcome

    async def tick(self) -> None:
        """Housekeeping, once a second on the event loop: :meth:`RunBook.tick`, and a pass of the reaper when due
        (its deletions off the loop)."""
        self.runs.tick()
        if self.reaper.pass_due():
            expired = self.reaper.due()
            if expired:
                await asyncio.to_thread(self.reaper.delete, expired)

    def drain(self) -> None:
        """Shutdown, first part (any thread): see :meth:`Dispatcher.drain`."""
        self.dispatcher.drain()

    def close(self) -> None:
        """Stop the backend thread (after the queued jobs) and the backend (any thread)."""
        self.dispatcher.shutdown()
        if self.engine_sampler is not None:
            self.engine_sampler.close()
        self.backend.close()
