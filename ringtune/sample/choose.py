"""Choosing the next token from logits: greedy, temperature, top-k, top-p, by inverse CDF of one uniform per row.

For a row of logits ``l`` (untempered, [V]):

1. temperature 0: the argmax (greedy); nothing random is drawn.
2. ``z = l / temperature``; top_k (if on): keep the k largest ``z``; ``p = softmax(z)`` over the kept tokens.
3. top_p < 1: sort ``p`` descending and keep a token when the mass before it is < top_p: the smallest set of
   most likely tokens with mass >= top_p. The kept mass is renormalised.
4. With ``u`` uniform in [0, 1) (one per row, from that sequence's own generator) return the token where the
   cumulative kept probability (float64) first exceeds ``u · total``.

:func:`token_probs` is the distribution of step 4's token; :func:`reference_token_probs` computes it for one
row in plain Python, the oracle of the tests. Neither changes the log-prob reported for a sampled token, which
is always the model's own ``log_softmax(l)`` (see :mod:`ringtune.sample.sampler`).
"""

from __future__ import annotations

import math

import torch

from ringtune.sample.params import SamplingParams


def _filtered(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probs [B, n], ids [B, n] or None for n = V in vocab order): the kept, renormalisable weights."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(acc) / params.temperature
    ids = None
    if 0 < params.top_k < z.shape[-1]:
        z, ids = z.topk(params.top_k, dim=-1)  # sorted, largest first
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        if ids is None:
            probs, ids = probs.sort(dim=-1, descending=True)
        cum = probs.to(torch.float64).cumsum(dim=-1)
        before = cum - probs.to(torch.float64)
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    return probs, ids


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> the probability [B, V] (float64) that :func:`choose_tokens` picks each token."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float64).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    probs, ids = _filtered(logits, params)
    probs = probs.to(torch.float64)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if ids is None:
        return probs
    return torch.zeros_like(logits, dtype=torch.float64).scatter_(1, ids, probs)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """The next token of every row.

    Args:
        logits: [B, V] untempered logits (float32, or float64 for a float64 model).
        params: the request's sampling parameters.
        uniforms: float64 [B] in [0, 1), one draw per row; None when ``params.greedy``.
    Returns:
        int64 [B] token ids.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    if uniforms is None or uniforms.shape != (logits.shape[0],):
        raise ValueError(f"uniforms must be float64 [B={logits.shape[0]}] when sampling; got {uniforms}")
    probs, ids = _filtered(logits, params)
    cum = probs.to(torch.float64).cumsum(dim=-1)
    target = uniforms.to(cum.device)[:, None] * cum[:, -1:]
    index = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[-1] - 1)
    return (index if ids is None else ids.gather(1, index))[:, 0]


def reference_token_probs(logits: list[float], params: SamplingParams) -> dict[int, float]:
    """Plain-Python oracle of :func:`token_probs` for one row: ``{token: probability}`` of the kept tokens."""
    if params.greedy:
        return {max(range(len(logits)), key=lambda i: logits[i]): 1.0}
    z = [x / params.temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if params.top_k != -1:
        order = order[: params.top_k]
    top = max(z[i] for i in order)
    weights = {i: math.exp(z[i] - top) for i in order}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if params.top_p < 1.0:
        kept, mass = {}, 0.0
        for i in order:
            if mass >= params.top_p:
                break
            kept[i] = probs[i]
            mass += probs[i]
        probs = {i: p / mass for i, p in kept.items()}
    return probs
