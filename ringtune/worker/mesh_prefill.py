"""Long prompts of a ``sample`` command through the DP×CP training forward of the session's snapshot.

A sampling request whose prompt is long (:func:`ringtune.sample.mesh_prompts.takes_mesh_forward`) does not prefill
on one rank: every rank runs the prompts together through the mesh's forward (:func:`prompts_forward`), and each
prompt's log-probs and caches end up on the rank that decodes it (:mod:`ringtune.worker.decode_jobs`).
"""

from __future__ import annotations

from collections.abc import Callable

from ringtune.errors import UserInputError
from ringtune.models.decoder import CausalLM
from ringtune.parallel.control import RankFailedError, all_gather_objects, attempt
from ringtune.parallel.mesh import ParallelMesh
from ringtune.sample.alt_tokens import AltDraws
from ringtune.sample.mesh_prompts import MeshLayout, PromptForward, prompts_forward
from ringtune.sample.params import DEFAULT_MAX_TOKENS
from ringtune.sample.pool import SampleRequest
from ringtune.sample.request_checks import check_request, check_targets


def check_mesh_requests(requests: list[SampleRequest], vocab: int) -> None:
    """UserInputError (ValueError for a seed the gateway should have fixed) for a request the mesh forward cannot
    run; called before any collective, so every rank reaches the same verdict."""
    for r in requests:
        alt_k = r.prompt_alt_tokens_k
        check_request([r.prompt], vocab, r.num_samples, r.topk_prompt_logprobs, 1, r.topk_sample_logprobs, alt_k)
        if alt_k and r.params.seed is None:
            raise ValueError("prompt_alt_tokens_k on the mesh needs a fixed seed (SampleRequest.with_fixed_seed)")
        if r.target_tokens is not None:
            check_targets([r.target_tokens], [list(r.prompt)], vocab)


def prefill_on_mesh(
    model: CausalLM,
    mesh: ParallelMesh | None,
    layout: MeshLayout,
    requests: list[SampleRequest],
    repair: Callable[[], None],
) -> dict[int, PromptForward]:
    """The prompts of ``requests`` through ``model``'s DP×CP forward (every rank holds the same snapshot) in
    ``layout``; ``{request index: PromptForward}`` of the requests this rank decodes, with their caches when they
    generate more than one token. Collective over the whole mesh.

    Requests are checked first (:func:`check_mesh_requests`). A rank failing in the forward leaves its peers'
    data groups out of step: after the ranks agree on it, ``repair()`` rebuilds them on every rank (as the trainer
    does); the error is raised on the failing rank, a RankFailedError on the others.
    """
    check_mesh_requests(requests, model.config.vocab_size)
    groups: dict[tuple[bool, int, int, bool, int, float], list[int]] = {}
    for i, r in enumerate(requests):
        decodes = (r.params.max_tokens or DEFAULT_MAX_TOKENS) > 1
        alt = (r.prompt_alt_tokens_k, r.params.temperature if r.prompt_alt_tokens_k else 0.0)
        groups.setdefault((r.prompt_logprobs, r.topk_prompt_logprobs, r.target_k, decodes, *alt), []).append(i)
    forwards: dict[int, PromptForward] = {}

    def run() -> None:
        for (want_lp, topk, target_k, decodes, alt_k, temperature), members in groups.items():
            prompts = [requests[i].prompt for i in members]
            targets = [requests[i].target_tokens for i in members] if target_k else None
            alt = None
            if alt_k:  # every seed was checked above: fixed, the same on every rank
                seeds = tuple(int(requests[i].params.seed) for i in members)  # type: ignore[arg-type]
                alt = AltDraws(alt_k, temperature, seeds)
            got = prompts_forward(
                model,
                mesh,
                prompts,
                layout,
                prompt_logprobs=want_lp,
                topk=topk,
                capture=decodes,
                targets=targets,  # type: ignore[arg-type]
                alt=alt,
                images=[requests[i].images for i in members],
            )
            forwards.update((members[j], forward) for j, forward in got.items())

    _, error = attempt(run)
    control = mesh.control_group if mesh else None
    verdicts = all_gather_objects(None if error is None else isinstance(error, UserInputError), control)
    if any(v is False for v in verdicts):  # a rank failed inside a collective: fresh data groups
        repair()
    if error is not None:
        raise error
    if any(v is not None for v in verdicts):
        raise RankFailedError("another rank failed in the prompt forward of a sampling request")
    return forwards
