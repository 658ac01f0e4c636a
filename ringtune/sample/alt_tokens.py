"""Tinker's ``prompt_alt_tokens``: k independent draws per prompt position from the model's next-token distribution.

For a prompt of n tokens and ``k = prompt_alt_tokens_k``, row i of the answer (i in [0, n−1)) holds k draws, with
replacement, from the model's distribution of prompt token i + 1 given ``prompt[:i+1]`` (the logits of the
hidden state at position i): alternatives to ``prompt[i+1]``, taken in the prefill that serves the request.

- **Distribution**: ``softmax(logits / temperature)`` at the request's temperature; top_k and top_p do not
  apply (the SDK asks for the model's distribution at the request's temperature). Temperature 0: the argmax,
  k times.
- **Log-probs**: each drawn token's untempered ``log_softmax(logits)`` entry (float32; float64 for a float64
  model): the model's log-prob, the same quantity as a sampled token's log-prob (:mod:`ringtune.sample.sampler`).
- **Randomness**: draw j at row i takes the uniform ``u[i, j]`` of :func:`alt_uniforms` (a generator seeded by a
  hash of the request's seed; float64 [n−1, k], one call per prompt) and returns the token where the cumulative
  tempered probability (float64, vocabulary order) first exceeds ``u · total``, as :mod:`ringtune.sample.choose`
  does for a sampled token. The uniforms depend on the seed and the prompt length only, so the one-rank prefill
  and the DP×CP forward pick the same draws (ranks holding parts of a prompt read their rows of the same
  uniforms: the request's seed must be fixed before the command reaches the ranks, see
  :meth:`ringtune.sample.pool.SampleRequest.with_fixed_seed`).

Computed in tiles of rows (never [T × V] logits at once), beside the top-k prompt log-probs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_PROMPT_ALT_TOKENS_K = 100
"""Largest ``prompt_alt_tokens_k`` (draws per prompt position)."""

ALT_TILE_BYTES = 64 * 1024 * 1024
"""Byte budget of one tile of float64 cumulative probabilities."""


AltTokens = tuple[torch.Tensor, torch.Tensor]
"""One prompt's answer: (ids int64 [n-1, k], untempered log-probs [n-1, k]) on the CPU."""


@dataclass(frozen=True)
class AltDraws:
    """What a prefill draws: ``k`` per prompt position at ``temperature``, with one seed per prompt (in order)."""

    k: int
    temperature: float
    seeds: tuple[int, ...]

    def for_prompts(self, indices: Sequence[int]) -> AltDraws:
        """The same draws for the prompts at ``indices`` (a packed row's members)."""
        return AltDraws(self.k, self.temperature, tuple(self.seeds[i] for i in indices))


def row_uniforms(lens: Sequence[int], seeds: Sequence[int], k: int) -> torch.Tensor:
    """float64 [sum(lens), k]: each prompt's :func:`alt_uniforms` in row order, a zero row at its last token
    (which draws nothing): the row-shaped uniforms a CP rank slices its zigzag shard from."""
    parts = [torch.zeros(0, k, dtype=torch.float64, device="cpu")]  # host draws: callers move their slice
    for n, seed in zip(lens, seeds, strict=True):
        parts += [alt_uniforms(seed, n - 1, k), torch.zeros(1, k, dtype=torch.float64, device="cpu")]
    return torch.cat(parts)


def split_rows(ids: torch.Tensor, logprobs: torch.Tensor, lens: Sequence[int]) -> list[AltTokens]:
    """Per prompt (n−1 rows each, in order) of draws stacked over the prompts' draw rows; on the CPU."""
    out, at = [], 0
    for n in lens:
        out.append((ids[at : at + n - 1].cpu(), logprobs[at : at + n - 1].cpu()))
        at += n - 1
    return out


def alt_uniforms(seed: int, rows: int, k: int) -> torch.Tensor:
    """float64 [rows, k] in [0, 1): the uniforms of a prompt with ``rows = n − 1`` draw rows, seeded ``seed``."""
    digest = hashlib.sha256(f"ringtune-alt-tokens:{seed}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.rand((rows, k), generator=generator, dtype=torch.float64, device="cpu")  # the generator's device


def draw_alt_tokens(
    hidden: torch.Tensor, weight: torch.Tensor, uniforms: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws from ``softmax(hidden @ weight.T / temperature)`` per row (see the module docstring).

    Args:
        hidden: [m, D] final hidden states (the positions whose next token is drawn).
        weight: [V, D] output weight.
        uniforms: float64 [m, k] in [0, 1) (ignored at temperature 0).
        temperature: >= 0; 0 draws the argmax k times.
    Returns:
        ``(ids int64 [m, k], logprobs [m, k])``: the drawn tokens and their untempered log-probs, float32
        (float64 when ``hidden`` or ``weight`` is), on ``hidden``'s device.
    """
    m, k = uniforms.shape
    if hidden.shape[0] != m:
        raise ValueError(f"hidden has {hidden.shape[0]} rows and uniforms {m}")
    acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    vocab = weight.shape[0]
    rows = max(1, ALT_TILE_BYTES // (8 * vocab))
    ids_out = torch.zeros((m, k), dtype=torch.int64, device=hidden.device)
    lps_out = torch.zeros((m, k), dtype=acc, device=hidden.device)
    w = weight.to(acc)
    for start in range(0, m, rows):
        stop = min(start + rows, m)
        logits = hidden[start:stop].to(acc) @ w.t()
        if temperature == 0.0:
            ids = logits.argmax(dim=-1, keepdim=True).expand(-1, k)
        else:
            cum = torch.softmax(logits / temperature, dim=-1).to(torch.float64).cumsum(dim=-1)
            target = uniforms[start:stop].to(cum.device) * cum[:, -1:]
            ids = torch.searchsorted(cum, target, right=True).clamp_(max=vocab - 1)
        ids_out[start:stop] = ids
        lps_out[start:stop] = torch.log_softmax(logits, dim=-1).gather(1, ids)
    return ids_out, lps_out
