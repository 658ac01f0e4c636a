"""One logits tile of the log-prob head, after its products: exps in cache-sized blocks, then its gradients.

A tile holds the logits ``l`` [vocab block, tokens] (vocabulary-major: ``logprob_head._tile_logits``).
The gradient of the tile's log-probs, times the upstream gradient ``g`` [tokens, K], is

    p = e · diag(c) + Σ_k onehot(label_k) · g_k,    e = exp(l − shift) (in place of l),

with ``shift`` the tokens' running maximum and ``c = −Σ_k g_k / Σ_v e`` (one pass: the forward normalises by the
sums it has just made) or ``shift = lse`` and ``c = −Σ_k g_k`` (the backward, which knows the log-sum-exp).
``p`` is never formed: the per-token scale ``c`` goes onto the small operands of the two gradient products and
the one-hot part is a gather / index-add of [tokens, K] rows:

    d_hidden = c ⊙ (eᵀ W) + Σ_k g_k W[label_k],    d_W = e (c ⊙ h) + Σ_k onehot(label_k)ᵀ (g_k h),
    d_bias = e c + Σ_k onehot(label_k)ᵀ g_k.

:func:`exp_blocks` walks the tile in blocks of :data:`CACHE_BLOCK_BYTES` (CPU; one block on other devices):
subtract, exp, column sums and ``eᵀ W`` of a block while it is in cache, where whole-tile passes each went to
memory (a 25 MB tile of 192 tokens × 32K vocabulary: 64-68 ms per tile against 69-74 for whole-tile passes
and a normalised ``p``, the three products included, 2 threads). Same values up to summation order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ringtune.models.logprob_tiles import accumulator_dtype, spans

CACHE_BLOCK_BYTES = 4 * 1024 * 1024
"""Bytes of logits per block of :func:`exp_blocks` on a CPU (2048-8192 rows of 192 tokens measured alike)."""

_EXP_FLOOR = {dtype: math.log(torch.finfo(dtype).tiny) + 1 for dtype in (torch.float32, torch.float64)}


def exp_(shifted: torch.Tensor) -> torch.Tensor:
    """``exp`` in place of arguments <= 0, floored at ``log(tiny) + 1`` so that no result is subnormal.

    x86 CPUs take a slow path for a subnormal result (measured 4.6x on a whole tile whose logits spread
    over more than 87 nats, which trained models reach). exp of the floor is 3e-38 in float32 (6e-308 in
    float64) instead of a smaller number or 0; a sum of exps holds at least 1 (the max), so V such terms
    change it by less than V · 3e-38, far below one ulp, and a gradient entry by as little.
    """
    return shifted.clamp_(min=_EXP_FLOOR[shifted.dtype]).exp_()


def block_rows(logits: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges of ``logits`` [vocab block, tokens] of about :data:`CACHE_BLOCK_BYTES` each (CPU), else one."""
    rows = logits.shape[0]
    step = rows
    if logits.device.type == "cpu":
        step = max(1, CACHE_BLOCK_BYTES // max(1, logits.shape[1] * logits.element_size()))
    return spans(rows, step)


def _exp_by_block(logits: torch.Tensor, shift: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Each :func:`block_rows` range ``(a, b)`` of ``logits`` [Vb, t] with its rows made ``exp(l − shift)`` in place
    (``shift`` [t]; floored as :func:`exp_`), while the block is in cache for the caller's work on it."""
    for a, b in block_rows(logits):
        yield a, b, exp_(logits[a:b].sub_(shift))


def exp_blocks(
    logits: torch.Tensor, shift: torch.Tensor, w_block: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` [Vb, t] becomes ``e = exp(logits − shift)`` in place (``shift`` [t], each column's own; floored as
    :func:`exp_`), block by block; returns ``(Σ_v e [t], eᵀ @ w_block [t, D] or None without w_block)``."""
    sums = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
    e_t_w = None if w_block is None else logits.new_zeros(logits.shape[1], w_block.shape[1])
    for a, b, block in _exp_by_block(logits, shift):
        sums += block.sum(dim=0)
        if e_t_w is not None and w_block is not None:
            e_t_w.addmm_(block.T, w_block[a:b])
    return sums, e_t_w


@dataclass(frozen=True)
class TileGradient:
    """``p = e · diag(c) + Σ_k onehot(cols[:, k]) · g[:, k]`` of one tile, unformed (see the module docstring).

    ``e`` [Vb, t] the tile's exps (the logits buffer), ``c`` [t], ``cols`` [t, K] each label's column in the block
    (clamped), ``g`` [t, K] the upstream gradient where the label lies in the block, else 0; ``e_t_w`` [t, D]:
    ``eᵀ @ w_block`` when :func:`exp_blocks` made it (d_hidden wanted), else None.
    """

    e: torch.Tensor
    c: torch.Tensor
    cols: torch.Tensor
    g: torch.Tensor
    e_t_w: torch.Tensor | None


class TileGrads:
    """d_hidden [T, D], d_weight [V, D], d_bias [V] accumulated tile by tile (each None unless ``need`` asks).

    A gradient already in the accumulator dtype is accumulated in place (views of its rows); a narrower one
    (bf16) is accumulated in float32 (d_hidden [T, D]; d_weight / d_bias one vocab block at a time) and
    rounded once.
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, need: tuple[bool, ...]
    ) -> None:
        self.acc = accumulator_dtype(hidden.dtype, weight.dtype)
        self.hidden_dtype = hidden.dtype
        self.d_hidden = torch.zeros(hidden.shape, dtype=self.acc, device=hidden.device) if need[0] else None
        self.d_weight = torch.zeros_like(weight) if need[1] else None
        self.d_bias = torch.zeros_like(bias) if need[2] and bias is not None else None
        self.dw_block: torch.Tensor | None = None
        self.db_block: torch.Tensor | None = None

    def open_block(self, v0: int, v1: int, w_block: torch.Tensor) -> None:
        """Start the vocab block [v0, v1) (``w_block``: its weight rows in the accumulator dtype)."""
        if self.d_weight is not None:
            narrow = self.d_weight.dtype != self.acc
            self.dw_block = w_block.new_zeros((v1 - v0, w_block.shape[1])) if narrow else self.d_weight[v0:v1]
        if self.d_bias is not None:
            self.db_block = w_block.new_zeros(v1 - v0) if self.d_bias.dtype != self.acc else self.d_bias[v0:v1]

    def add(self, rows: torch.Tensor, tile: TileGradient, h_tile: torch.Tensor, w_block: torch.Tensor) -> None:
        """Add one tile's gradients (:class:`TileGradient`) of the hidden rows ``rows`` (``h_tile`` [t, D])."""
        if self.dw_block is not None:
            scaled = h_tile * tile.c.unsqueeze(1)
            for a, b in block_rows(tile.e):
                self.dw_block[a:b].addmm_(tile.e[a:b], scaled)
        if self.db_block is not None:
            self.db_block.add_(tile.e @ tile.c)
        e_t_w = None
        if self.d_hidden is not None:
            e_t_w = tile.e_t_w if tile.e_t_w is not None else tile.e.T @ w_block
        self._add_labels(rows, tile, e_t_w, h_tile, w_block)

    def add_with_exps(
        self, rows: torch.Tensor, shift: torch.Tensor, tile: TileGradient, h_tile: torch.Tensor, w_block: torch.Tensor
    ) -> None:
        """:meth:`add` for a tile whose scale ``c`` is known before its exps (the backward, ``shift`` = the tokens'
        log-sum-exp [t]): ``tile.e`` holds the logits, made ``exp(l − shift)`` in place, and each block's exps,
        ``eᵀ W``, ``e (c ⊙ h)`` and ``e c`` are made in one walk of the tile."""
        e_t_w = tile.e.new_zeros(tile.e.shape[1], w_block.shape[1]) if self.d_hidden is not None else None
        scaled = h_tile * tile.c.unsqueeze(1)
        for a, b, block in _exp_by_block(tile.e, shift):
            if e_t_w is not None:
                e_t_w.addmm_(block.T, w_block[a:b])
            if self.dw_block is not None:
                self.dw_block[a:b].addmm_(block, scaled)
            if self.db_block is not None:
                self.db_block[a:b].add_(block @ tile.c)
        self._add_labels(rows, tile, e_t_w, h_tile, w_block)

    def _add_labels(
        self,
        rows: torch.Tensor,
        tile: TileGradient,
        e_t_w: torch.Tensor | None,
        h_tile: torch.Tensor,
        w_block: torch.Tensor,
    ) -> None:
        """d_hidden's rows ``c ⊙ e_t_w + Σ_k g_k W[label_k]`` and the one-hot parts of d_weight and d_bias."""
        flat_cols = tile.cols.reshape(-1)
        if self.d_hidden is not None and e_t_w is not None:
            label_w = w_block.index_select(0, flat_cols).view(*tile.cols.shape, -1)  # [t, K, D]
            label_rows = torch.einsum("tk,tkd->td", tile.g, label_w)
            self.d_hidden.index_add_(0, rows, e_t_w.mul_(tile.c.unsqueeze(1)).add_(label_rows))
        if self.dw_block is not None:
            self.dw_block.index_add_(0, flat_cols, (tile.g.unsqueeze(2) * h_tile.unsqueeze(1)).flatten(0, 1))
        if self.db_block is not None:
            self.db_block.index_add_(0, flat_cols, tile.g.reshape(-1))

    def close_block(self, v0: int, v1: int) -> None:
        """Round the vocab block [v0, v1)'s float32 accumulators into narrower (bf16) gradients."""
        if self.d_weight is not None and self.dw_block is not None and self.d_weight.dtype != self.acc:
            self.d_weight[v0:v1].copy_(self.dw_block)
        if self.d_bias is not None and self.db_block is not None and self.d_bias.dtype != self.acc:
            self.d_bias[v0:v1].copy_(self.db_block)

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        d_hidden = None if self.d_hidden is None else self.d_hidden.to(self.hidden_dtype)
        return d_hidden, self.d_weight, self.d_bias
