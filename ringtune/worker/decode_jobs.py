"""Decode jobs: the requests of one ``sample`` command, decoded across commands in slices.

``sample`` starts a job (its requests spread over the ranks, long prompts prefilled on the whole mesh first) and
runs its first slice; each ``sample_more`` runs the next one. Between slices the ranks execute other commands, so
a long generation does not hold the others back for its whole duration. Decoding itself is local to each rank;
after each slice the ranks agree whether every one finished (then the answers are gathered to rank 0), some failed
(the job is dropped and the error raised), or the job goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ringtune.parallel.control import RankFailedError, all_gather_objects, attempt, gather_object_to
from ringtune.parallel.mesh import ParallelMesh
from ringtune.sample.mesh_prompts import PromptForward, takes_mesh_forward
from ringtune.sample.pool import PoolGeneration, SampleRequest, SamplerPool
from ringtune.sample.sampler import PromptSamples

MeshPrefill = Callable[[str, list[SampleRequest]], dict[int, PromptForward]]
"""(sampler id, long-prompt requests) -> {index: PromptForward} of those this rank decodes (collective)."""


@dataclass(frozen=True)
class DecodeJob:
    """This rank's share of one ``sample`` command while it decodes across commands: the command's request
    count, the indices of the requests this rank decodes, and their generation."""

    count: int
    mine: list[int]
    generation: PoolGeneration


class DecodeJobs:
    """This rank's running decode jobs, by job id.

    Args:
        samplers: the rank's sampling sessions (snapshots and decode batches).
        mesh: the mesh (None: one process); its control group spreads the requests and agrees on each slice.
        min_mesh_prompt_tokens: the prompt length from which a request is prefilled on the whole mesh.
        prefill_on_mesh: how those prompts run (:func:`ringtune.worker.mesh_prefill.prefill_on_mesh`).
    """

    def __init__(
        self,
        samplers: SamplerPool,
        mesh: ParallelMesh | None,
        *,
        min_mesh_prompt_tokens: int,
        prefill_on_mesh: MeshPrefill,
    ) -> None:
        self.samplers, self.mesh = samplers, mesh
        self.min_mesh_prompt_tokens, self.prefill_on_mesh = min_mesh_prompt_tokens, prefill_on_mesh
        self.jobs: dict[str, DecodeJob] = {}
        self._next_rank = 0  # the rank the next job's first short request decodes on

    def start(self, args: dict[str, Any]) -> list[PromptSamples] | None:
        """Start decode job ``args["job_id"]`` for every request of a ``sample`` command's ``args`` and run its first
        slice (:meth:`advance`): the answers on rank 0 in request order once every rank finished (None elsewhere,
        and None on every rank while the job goes on: ``sample_more`` continues it).

        Requests with long prompts run their prompts together on the whole mesh and are decoded by the rank each
        prompt was given to; the others are spread round-robin over the ranks, each prefilling and decoding its
        share on its own snapshot replica (:meth:`SamplerPool.begin`), continuing where the previous job's
        stopped. ``slice_s`` None: the job runs to the end in this command. Collective over the control group.
        """
        requests: list[SampleRequest] = args["requests"]
        sampler_id = args["sampler_id"]
        job_id = args.get("job_id") or "sample"
        if job_id in self.jobs:
            raise ValueError(f"decode job {job_id!r} already exists")
        group = self.mesh.control_group if self.mesh else None
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        limit = self.min_mesh_prompt_tokens
        long = [takes_mesh_forward(len(r.prompt), min_prompt_tokens=limit) for r in requests]
        on_mesh = [i for i, is_long in enumerate(long) if is_long]
        spread = [i for i, is_long in enumerate(long) if not is_long]
        prefilled = self.prefill_on_mesh(sampler_id, [requests[i] for i in on_mesh]) if on_mesh else {}
        # round-robin from where the previous job stopped (the same count on every rank: commands are
        # replicated), so that one-request jobs do not all land on rank 0
        first = self._next_rank
        self._next_rank = (first + len(spread)) % size
        mine = [on_mesh[j] for j in sorted(prefilled)] + [i for n, i in enumerate(spread) if (first + n) % size == rank]

        def begin() -> DecodeJob:
            forwards = [prefilled[j] for j in sorted(prefilled)] + [None] * (len(mine) - len(prefilled))
            generation = self.samplers.begin(sampler_id, [requests[i] for i in mine], prefilled=forwards)
            return DecodeJob(len(requests), mine, generation)

        job, error = attempt(begin)
        return self.advance(job_id, job, error, args.get("slice_s"))

    def more(self, args: dict[str, Any]) -> list[PromptSamples] | None:
        """The next slice of decode job ``args["job_id"]`` (:meth:`advance`); a job this rank does not hold (lost
        when the worker ranks restarted) fails the request as a server error."""
        job_id = args["job_id"]
        job = self.jobs.get(job_id)
        error = None if job is not None else RuntimeError(f"decode job {job_id!r} is gone (the worker ranks restarted)")
        return self.advance(job_id, job, error, args.get("slice_s"))

    def advance(
        self, job_id: str, job: DecodeJob | None, error: BaseException | None, slice_s: float | None
    ) -> list[PromptSamples] | None:
        """Decode this rank's share of ``job`` for ``slice_s`` seconds (None: to the end), then agree over the
        control group whether every rank finished: if so the answers are gathered to rank 0 (in request order;
        None elsewhere) and the job is dropped; if any rank failed the job is dropped and the error raised
        (``error``, or a RankFailedError on the ranks that did not fail); otherwise the job is kept and None
        returned."""
        if error is None and job is not None:
            deadline = None if slice_s is None else time.monotonic() + slice_s
            _, error = attempt(lambda: job.generation.advance(deadline))
        group = self.mesh.control_group if self.mesh else None
        states = all_gather_objects(None if error is not None else job.generation.finished, group)  # type: ignore[union-attr]
        if any(state is None for state in states):
            self.jobs.pop(job_id, None)
            if job is not None:  # its rows leave the rank's shared decode batch
                job.generation.close()
            if error is not None:
                raise error
            raise RankFailedError("another rank failed while decoding a sampling request")
        if not all(states):
            self.jobs[job_id] = job  # type: ignore[assignment]
            return None
        self.jobs.pop(job_id, None)
        assert job is not None
        parts = gather_object_to(list(zip(job.mine, job.generation.results(), strict=True)), group, dst=0)
        if parts is None:
            return None
        answers = {i: result for pairs in parts for i, result in pairs}
        return [answers[i] for i in range(job.count)]
