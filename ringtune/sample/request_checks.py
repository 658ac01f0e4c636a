"""What a sampling request may ask for: the limits of its fields and the checks that name a bad one.

Shared by :func:`ringtune.sample.sampler.generate` (every request it runs), the worker's mesh prefill
(:mod:`ringtune.worker.executor`, before any collective) and the gateway (``asample`` bodies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringtune.engine.batch import MAX_TARGET_K
from ringtune.errors import UserInputError
from ringtune.sample.alt_tokens import MAX_PROMPT_ALT_TOKENS_K

MAX_NUM_SAMPLES = 128
"""Most samples per prompt."""

MAX_TOPK_PROMPT_LOGPROBS = 100
"""Largest ``topk_prompt_logprobs``."""

MAX_TOPK_SAMPLE_LOGPROBS = 100
"""Largest ``topk_sample_logprobs``."""


def check_request(
    prompts: Sequence[Sequence[int]],
    vocab: int,
    num_samples: int,
    topk_prompt_logprobs: int,
    max_batch: int,
    topk_sample_logprobs: int = 0,
    prompt_alt_tokens_k: int = 0,
) -> list[list[int]]:
    """The prompts as lists; UserInputError naming the first bad field, its value and the limit."""
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise UserInputError(f"num_samples={num_samples!r} must be an int in [1, {MAX_NUM_SAMPLES}]")
    for name, k, limit in (
        ("topk_prompt_logprobs", topk_prompt_logprobs, min(MAX_TOPK_PROMPT_LOGPROBS, vocab)),
        ("topk_sample_logprobs", topk_sample_logprobs, min(MAX_TOPK_SAMPLE_LOGPROBS, vocab)),
        ("prompt_alt_tokens_k", prompt_alt_tokens_k, MAX_PROMPT_ALT_TOKENS_K),  # draws repeat: no vocab bound
    ):
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= limit:
            raise UserInputError(f"{name}={k!r} must be an int in [0, {limit}]")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise UserInputError(f"max_batch={max_batch!r} must be an int >= 1")
    out = []
    for i, prompt in enumerate(prompts):
        tokens = list(prompt)
        if not tokens:
            raise UserInputError(f"prompts[{i}] is empty; a prompt needs at least 1 token")
        for j, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise UserInputError(f"prompts[{i}][{j}]={t!r} must be a token id in [0, vocab_size={vocab})")
        out.append(tokens)
    return out


def check_targets(
    targets: Sequence[torch.Tensor] | None, prompts: list[list[int]], vocab: int
) -> list[torch.Tensor] | None:
    """Targets as int64 [n−1, K] (the same K ≤ MAX_TARGET_K for all prompts), ids in [−1, vocab)."""
    if targets is None:
        return None
    if len(targets) != len(prompts):
        raise UserInputError(f"target_prompt_logprobs: {len(targets)} tensors for {len(prompts)} prompts")
    out = [torch.as_tensor(t, dtype=torch.int64, device="cpu") for t in targets]  # request values, on the host
    k = out[0].shape[-1] if out and out[0].dim() == 2 else -1  # every prompt's K must be the first one's
    for i, (t, p) in enumerate(zip(out, prompts, strict=True)):
        if t.dim() != 2 or t.shape[0] != len(p) - 1 or not 1 <= t.shape[1] <= MAX_TARGET_K or t.shape[1] != k:
            raise UserInputError(
                f"target_prompt_logprobs[{i}]: shape {list(t.shape)} must be [len(prompt) - 1 = {len(p) - 1}, K] "
                f"with 1 <= K <= {MAX_TARGET_K} (the same K for every prompt of a call)"
            )
        if t.numel() and (int(t.min()) < -1 or int(t.max()) >= vocab):
            bad = int(t.min()) if int(t.min()) < -1 else int(t.max())
            raise UserInputError(f"target_prompt_logprobs[{i}]: token id {bad} is outside [-1, vocab_size={vocab})")
    return out
