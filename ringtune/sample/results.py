"""What a generation returns: :class:`PromptSamples` per prompt, of :class:`SampledSequence` per sample (plain
dataclasses, picklable: a worker sends them back to the gateway)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringtune.sample.alt_tokens import AltTokens


@dataclass(frozen=True)
class SampledSequence:
    """One generated sequence: ``tokens`` (the stop token last, once, if it stopped on one), the untempered
    log-prob of each, ``stop_reason`` "stop" or "length" and, if asked (``topk_sample_logprobs`` = k > 0),
    per token the k most likely ``(token, logprob)`` of the untempered step distribution ``logprobs`` reports
    from (not the tempered, filtered one it was drawn from), best first."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk_logprobs: list[list[tuple[int, float]]] | None = None
    routing: torch.Tensor | None = None  # int16 [len(prompt) + len(tokens) - 1, MoE layers, k] when recorded


@dataclass(frozen=True)
class PromptSamples:
    """The result for one prompt: its ``num_samples`` sequences (in sample order) and, if asked, the prompt's
    log-probs (entry 0 None) and top-k log-probs (entry 0 None; else ``[(token, logprob)] * k``, best first)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: torch.Tensor | None = None  # [n−1, K] for the request's targets (0.0 where −1)
    prompt_alt_tokens: AltTokens | None = None  # (ids int64 [n−1, k], log-probs [n−1, k]) when asked
