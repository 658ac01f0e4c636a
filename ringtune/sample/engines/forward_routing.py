"""MoE routing (R3) of an external engine's samples, taken from ringtune's own forward of the sampled tokens.

An engine (vLLM) returns tokens and log-probs, not the experts each token was routed to under ringtune's model.
With ``--routing-replay`` on a MoE model every sampled sequence must carry that routing
(:attr:`~ringtune.sample.sampler.SampledSequence.routing`: per fed token, ``prompt + tokens[:-1]``, the k experts
of each MoE layer), so the gateway can replay it in training (:mod:`ringtune.gateway.routing_records`, and the
stability records of ``stable_reinforce``). It is recorded by a prefill of those fed tokens on a built-in sampling
session of the same weights: a one-token, greedy, one-sample request per sequence whose prompt is
``prompt + tokens[:-1]``; the built-in sampler records the routing of every prompt position, which is exactly the
sequence's ``[len(prompt) + len(tokens) - 1, L, k]``. Its one sampled token is discarded.

Pure request building and merging; the forward itself is the caller's (:mod:`ringtune.gateway.vllm_sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest
from ringtune.sample.sampler import PromptSamples, SampledSequence


def _routed(request: SampleRequest, seq: SampledSequence) -> bool:
    return not request.images and len(seq.tokens) > 0


def routing_requests(requests: Sequence[SampleRequest], results: Sequence[PromptSamples]) -> list[SampleRequest]:
    """The forward's requests for the routing of every sampled sequence of ``results`` (``requests[i]``'s answer),
    in order: request by request, sample by sample. Requests with images get none (their pad tokens do not
    identify the images, so their routing is never replayed), nor do sequences without tokens."""
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for request, result in zip(requests, results, strict=True):
        for seq in result.sequences:
            if _routed(request, seq):
                out.append(SampleRequest(prompt=list(request.prompt) + list(seq.tokens[:-1]), params=greedy_one))
    return out


def with_routing(
    requests: Sequence[SampleRequest], results: Sequence[PromptSamples], forward: Sequence[PromptSamples]
) -> list[PromptSamples]:
    """``results`` with each sequence's ``routing`` taken from ``forward`` (the answers to
    :func:`routing_requests` of the same arguments, in its order). A forward answer without routing (a dense
    model, or a prompt the backend prefilled across its mesh, which records none) leaves the sequence's None.
    ValueError when ``forward`` does not hold one answer per sequence or a routing has the wrong length."""
    answers = iter(forward)
    out = []
    for request, result in zip(requests, results, strict=True):
        sequences = []
        for seq in result.sequences:
            if not _routed(request, seq):
                sequences.append(seq)
                continue
            answer = next(answers, None)
            if answer is None:
                raise ValueError("the routing forward returned fewer answers than there are sampled sequences")
            routing = answer.sequences[0].routing
            fed = len(request.prompt) + len(seq.tokens) - 1
            if routing is not None and int(routing.shape[0]) != fed:
                raise ValueError(f"routing of {int(routing.shape[0])} positions for {fed} fed tokens")
            sequences.append(replace(seq, routing=routing))
        out.append(replace(result, sequences=sequences))
    if next(answers, None) is not None:
        raise ValueError("the routing forward returned more answers than there are sampled sequences")
    return out
