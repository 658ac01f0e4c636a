"""How the log-prob head walks [tokens × vocab]: the tile shape, sized from the rank's own tokens.

One place decides the tile (:func:`tile_shape`); :func:`ringtune.models.logprob_head.label_logprobs` and the
memory planner (``ringtune plan``) both read it. The rule, for a rank holding ``T`` tokens of hidden size
``D`` and a vocabulary of ``V``, accumulator element ``a`` bytes (4 for float32 / bf16, 8 for float64):

- the logits tile holds at most ``TILE_HIDDEN_MULTIPLE × T × D × a`` bytes: as much as a few copies of the
  rank's hidden states, so under CP (a rank holds ``T / CP`` tokens) the tile shrinks with the shard, like the
  activations, instead of staying a per-rank constant;
- floor: ``MIN_TILE_TOKENS`` tokens over the whole vocabulary (a matmul of fewer rows reads the weight for too
  little work), so short rows are not cut into tiny tiles;
- cap: ``max_chunk_bytes`` (default 256 MiB) always wins, floor included;
- alignment: a tile of at least ``TILE_TOKEN_ALIGN`` tokens holds a multiple of it (rounded down, so within the
  budget). The tile's tokens are the leading dimension of the vocabulary-major logits: on x86 (MKL / oneDNN sgemm)
  ``[V, D] @ [D, 255]`` ran at 95 GFLOPS where 192 or 256 columns ran at 170 on the same 2 threads, and the one-pass
  head of an 8184-token rank (12 × 682) took 0.749× the time with 192-token tiles than with 255
  (``benchmarks/head_tile_align.py``); GPUs want multiples of 64 too (tensor-core tiles).

Tiles span the whole vocabulary unless one token's logits exceed the budget, or the float32 cast of a narrower
(bf16) weight block and its d_weight block would exceed ``max_chunk_bytes``; then the vocabulary is split
too. The head allocates one tile-sized logits buffer per pass (every tile is written into it) and per tile
``[tokens, D]`` products (``p @ weight``, the cast hidden rows), so its transients follow the same bound; its only
[T, D] buffer is d_hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_MAX_CHUNK_BYTES = 256 * 1024 * 1024
"""Cap of one logits tile (and of a float32 weight block / its d_weight block)."""

TILE_HIDDEN_MULTIPLE = 4
"""A logits tile holds at most this many times the bytes of the rank's hidden states [T, D] (accumulator dtype)."""

MIN_TILE_TOKENS = 128
"""Floor of a tile's tokens (when the cap allows it)."""

TILE_TOKEN_ALIGN = 64
"""A budget-sized tile of at least this many tokens holds a multiple of it (see the module docstring)."""


def accumulator_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32 (for float32, bfloat16, float16)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


@dataclass(frozen=True)
class TilePlan:
    """How [tokens × vocab] is walked: ``tokens`` rows × ``vocab`` columns of logits per tile."""

    tokens: int
    vocab: int

    def spans_vocab(self, vocab_size: int) -> bool:
        """Whether each tile holds whole rows of logits (then a tile knows its tokens' log-sum-exp)."""
        return self.vocab >= vocab_size


def spans(size: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``step`` (the last shorter) covering ``range(size)``; none for size 0."""
    return [(i, min(i + step, size)) for i in range(0, size, step)]


def tile_budget_bytes(tokens: int, dim: int, vocab: int, acc_bytes: int, max_chunk_bytes: int) -> int:
    """Bytes one logits tile may hold on a rank of ``tokens`` tokens (the rule in the module docstring)."""
    shard = TILE_HIDDEN_MULTIPLE * tokens * dim * acc_bytes
    floor = MIN_TILE_TOKENS * vocab * acc_bytes
    return min(max_chunk_bytes, max(shard, floor))


def tile_shape(
    tokens: int,
    vocab: int,
    dim: int,
    *,
    acc_bytes: int,
    weight_bytes: int,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    align: int | None = None,
) -> TilePlan:
    """The tile for ``tokens`` rows of hidden size ``dim`` against a [vocab, dim] weight of ``weight_bytes``
    per element, accumulated in ``acc_bytes``; explicit ``chunk_tokens`` / ``chunk_vocab`` win. ``align``: the
    multiple a budget-sized tile's tokens are rounded down to (None: :data:`TILE_TOKEN_ALIGN`; 1: none).

    Raises ValueError for a chunk size < 1 or a budget below one logit.
    """
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if max_chunk_bytes < acc_bytes:
        raise ValueError(f"max_chunk_bytes must be >= {acc_bytes} (one accumulator logit); got {max_chunk_bytes}")
    budget = tile_budget_bytes(tokens, dim, vocab, acc_bytes, max_chunk_bytes)
    if chunk_vocab is None:
        chunk_vocab = min(vocab, budget // acc_bytes)
        if weight_bytes != acc_bytes:  # the cast block and its d_weight block: constants, bounded by the cap
            chunk_vocab = min(chunk_vocab, max_chunk_bytes // (max(dim, 1) * acc_bytes))
    chunk_vocab = max(1, min(chunk_vocab, max(vocab, 1)))
    if chunk_tokens is None:
        chunk_tokens = budget // (chunk_vocab * acc_bytes)
        align = TILE_TOKEN_ALIGN if align is None else align
        if chunk_tokens >= align:
            chunk_tokens -= chunk_tokens % align
    return TilePlan(tokens=max(1, chunk_tokens), vocab=chunk_vocab)


def plan_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> TilePlan:
    """:func:`tile_shape` for ``hidden`` [T, D] (this rank's tokens) and ``weight`` [V, D].

    At V = 248K float32 the cap (256 MiB) gives 256-token tiles (270 fit, aligned down to 64) over the whole
    vocabulary once the rank holds more than ~3.3K tokens of hidden 5120; at V = 32K, D = 256 a rank of 8K tokens
    gets 256-token tiles (32 MiB), one of 8184 tokens 192-token tiles.
    """
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    vocab_size, dim = weight.shape
    return tile_shape(
        hidden.shape[0],
        vocab_size,
        dim,
        acc_bytes=torch.finfo(acc).bits // 8,
        weight_bytes=torch.finfo(weight.dtype).bits // 8,
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
        max_chunk_bytes=max_chunk_bytes,
    )
