"""The log-prob head: ``log_softmax(hidden @ weight.T + bias)[t, labels[t]]`` without a [T, V] logits tensor.

Full fine-tuning at long context cannot afford the logits: 32K tokens × a 248K vocabulary is 30 GiB in
float32, and autograd would keep it (and its softmax) for the backward. :func:`label_logprobs` walks
tiles of [tokens × vocab] instead:

- forward: per tile, the logits in float32 (float64 for float64 input), their log-sum-exp merged into a
  running one per token, and the label's logit; it keeps only the log-sum-exp of each scored token;
- backward: per tile, the logits again, ``p = (onehot(label) - softmax) · g`` (the gradient of a
  log-prob; a loss ``-logprob`` makes it the familiar ``softmax - onehot``), then
  ``d_hidden += p @ weight`` and ``d_weight += pᵀ @ hidden`` (``d_bias += Σ_t p``).

Tiles are token chunks over the whole vocabulary, unless one vocabulary row of logits or the cast of
a narrower (bf16) weight would not fit the byte budget; then the vocabulary is split in blocks too.
Tokens whose label is ``ignore_index`` are skipped (log-prob 0, no gradient). ``weight`` may be a tied
embedding matrix: autograd adds the head's ``d_weight`` to the embedding's gradient as for any reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringtune.errors import UserInputError

DEFAULT_MAX_CHUNK_BYTES = 256 * 1024 * 1024
"""Default byte budget of one logits tile (and of a float32 weight block / its d_weight block)."""


def accumulator_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32 (for float32, bfloat16, float16)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None, ignore_index: int
) -> None:
    """Shapes, dtypes and label range; raises where the bad value enters, before any compute."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, D]; got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, D] with D = {hidden.shape[1]}; got shape {tuple(weight.shape)}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point; got {hidden.dtype} and {weight.dtype}")
    if labels.dim() not in (1, 2) or labels.shape[0] != hidden.shape[0] or (labels.dim() == 2 and labels.shape[1] < 1):
        raise ValueError(f"labels must be [T] or [T, K] with T = {hidden.shape[0]}; got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor (int64); got {labels.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}]; got shape {tuple(bias.shape)}")
    vocab = weight.shape[0]
    scored = labels[labels != ignore_index]
    if scored.numel():
        lo, hi = int(scored.min()), int(scored.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise UserInputError(
                f"labels holds {bad}, outside the vocabulary [0, V) with V = {vocab} "
                f"(only ignore_index = {ignore_index} may lie outside it)"
            )


def reference_label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Plain ``log_softmax(hidden @ weight.T + bias, -1)[t, labels[t]]``, materialising the [T, V] logits.

    Args:
        hidden: [T, D] float (the final-norm output of T tokens, any layout: the head is per token).
        weight: [V, D] float (the LM head, or the tied embedding matrix); bias: optional [V].
        labels: integer [T] (or [T, K]), the target token(s) of each position; ``ignore_index`` marks an
            unscored entry.
    Returns:
        [T] log-probs in float32 (float64 for float64 input); 0 where ``labels == ignore_index``.
        Differentiable (through autograd; the ignored tokens get no gradient).
    Raises:
        UserInputError (a ValueError) if a label other than ``ignore_index`` lies outside [0, V).
    """
    _check_inputs(hidden, weight, labels, bias, ignore_index)
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    logits = hidden.to(acc) @ weight.to(acc).T
    if bias is not None:
        logits = logits + bias.to(acc)
    columns = labels.unsqueeze(1) if labels.dim() == 1 else labels
    scored = columns != ignore_index
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.where(scored, columns, 0).long())
    return torch.where(scored, picked, 0.0).reshape(labels.shape)


@dataclass(frozen=True)
class TilePlan:
    """How [tokens × vocab] is walked: ``tokens`` rows × ``vocab`` columns of logits per tile."""

    tokens: int
    vocab: int


def plan_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> TilePlan:
    """The tile shape for :func:`label_logprobs`: explicit sizes win, the byte budget picks the rest.

    Each of these stays within ``max_chunk_bytes``: the logits tile (tokens × vocab × 4 bytes, 8 for
    float64), and, when ``weight`` is narrower than the accumulator (bf16), its cast block and that
    block's d_weight accumulator (vocab × D × 4 bytes each). With float32 weights the vocabulary is
    split only when a single token's logits exceed the budget. At V = 248K float32 the default budget
    (256 MiB) gives 270-token chunks over the whole vocabulary.
    """
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    elem = torch.finfo(acc).bits // 8
    if max_chunk_bytes < elem:
        raise ValueError(f"max_chunk_bytes must be >= {elem} (one {acc} logit); got {max_chunk_bytes}")
    vocab_size, dim = weight.shape
    if chunk_vocab is None:
        chunk_vocab = min(vocab_size, max_chunk_bytes // elem)
        if weight.dtype != acc:
            chunk_vocab = min(chunk_vocab, max_chunk_bytes // (max(dim, 1) * elem))
    chunk_vocab = max(1, min(chunk_vocab, max(vocab_size, 1)))
    if chunk_tokens is None:
        chunk_tokens = max_chunk_bytes // (chunk_vocab * elem)
    return TilePlan(tokens=max(1, chunk_tokens), vocab=chunk_vocab)


def _tile_logits(h_tile: torch.Tensor, w_block: torch.Tensor, b_block: torch.Tensor | None) -> torch.Tensor:
    """[tokens, vocab] logits of one tile in the accumulator dtype (inputs already cast)."""
    logits = h_tile @ w_block.T
    if b_block is not None:
        logits.add_(b_block)
    return logits


def _label_columns(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the vocab block [start, start + width): each label's column (clamped) and whether it lies inside."""
    local = labels - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


def _blocks(size: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, size)) for i in range(0, size, step)]


def _forward_tile(
    h_tile: torch.Tensor,
    w_block: torch.Tensor,
    b_block: torch.Tensor | None,
    targets: torch.Tensor,
    v0: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's (log-sum-exp over its vocab block [tokens], label logits or 0 if outside it [tokens, K]).

    A function of its own so that the [tokens, vocab] logits are freed on return, before the next tile.
    """
    logits = _tile_logits(h_tile, w_block, b_block)
    cols, inside = _label_columns(targets, v0, w_block.shape[0])
    label_logit = torch.where(inside, logits.gather(1, cols), 0.0)
    row_max = logits.amax(dim=1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # a block masked to -inf by the bias
    block_lse = row_max + logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=1).log_()
    return block_lse, label_logit


def forward_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scored: torch.Tensor,
    targets: torch.Tensor,
    plan: TilePlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp [S] and label logits [S, K] of the S tokens ``hidden[scored]`` (labels ``targets`` [S, K]).

    Accumulator dtype throughout; vocab blocks are merged by ``logaddexp``.
    """
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    n = scored.numel()
    lse = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
    label_logit = torch.zeros(targets.shape, dtype=acc, device=hidden.device)
    for v0, v1 in _blocks(weight.shape[0] if n else 0, plan.vocab):
        w_block = weight[v0:v1].to(acc)
        b_block = None if bias is None else bias[v0:v1].to(acc)
        for t0, t1 in _blocks(n, plan.tokens):
            h_tile = hidden.index_select(0, scored[t0:t1]).to(acc)
            block_lse, block_label = _forward_tile(h_tile, w_block, b_block, targets[t0:t1], v0)
            torch.logaddexp(lse[t0:t1], block_lse, out=lse[t0:t1])
            label_logit[t0:t1] += block_label
    return lse, label_logit


def _backward_tile(
    h_tile: torch.Tensor,
    w_block: torch.Tensor,
    b_block: torch.Tensor | None,
    targets: torch.Tensor,
    v0: int,
    lse: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """d logprobs / d logits of one tile times the upstream gradient: ``Σ_k (onehot_k - softmax) · g_k``.

    ``targets`` and ``g`` are [tokens, K]; the result is [tokens, vocab].
    """
    p = _tile_logits(h_tile, w_block, b_block)
    p.sub_(lse.unsqueeze(1)).exp_().mul_(-g.sum(dim=1, keepdim=True))
    cols, inside = _label_columns(targets, v0, w_block.shape[0])
    p.scatter_add_(1, cols, torch.where(inside, g, 0.0))
    return p


def backward_tiles(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scored: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    plan: TilePlan,
    *,
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """d_hidden [T, D], d_weight [V, D], d_bias [V] (each None unless ``need`` asks), in the inputs' dtypes.

    ``grad_out`` [T, K] is the upstream gradient of the log-probs (0 at ignored entries); only the ``scored``
    rows take part; ``targets`` [S, K].
    A gradient already in the accumulator dtype is accumulated in place (views of its rows); a narrower
    one (bf16) is accumulated in float32 (d_hidden [T, D]; d_weight / d_bias one vocab block at a time)
    and rounded once.
    """
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    dim = weight.shape[1]
    n = scored.numel()
    g = grad_out.to(acc).index_select(0, scored)
    d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need[0] else None
    d_weight = torch.zeros_like(weight) if need[1] else None
    d_bias = torch.zeros_like(bias) if need[2] and bias is not None else None
    for v0, v1 in _blocks(weight.shape[0] if n else 0, plan.vocab):
        w_block = weight[v0:v1].to(acc)
        b_block = None if bias is None else bias[v0:v1].to(acc)
        dw_block = db_block = None
        if d_weight is not None:
            dw_block = d_weight[v0:v1] if d_weight.dtype == acc else w_block.new_zeros((v1 - v0, dim))
        if d_bias is not None:
            db_block = d_bias[v0:v1] if d_bias.dtype == acc else w_block.new_zeros(v1 - v0)
        for t0, t1 in _blocks(n, plan.tokens):
            rows = scored[t0:t1]
            h_tile = hidden.index_select(0, rows).to(acc)
            p = _backward_tile(h_tile, w_block, b_block, targets[t0:t1], v0, lse[t0:t1], g[t0:t1])
            if d_hidden is not None:
                d_hidden.index_add_(0, rows, p @ w_block)
            if dw_block is not None:
                dw_block.addmm_(p.T, h_tile)
            if db_block is not None:
                db_block.add_(p.sum(dim=0))
            del p  # free this tile before the next one is computed
        if d_weight is not None and d_weight.dtype != acc:
            d_weight[v0:v1].copy_(dw_block)
        if d_bias is not None and d_bias.dtype != acc:
            d_bias[v0:v1].copy_(db_block)
    if d_hidden is not None:
        d_hidden = d_hidden.to(hidden.dtype)
    return d_hidden, d_weight, d_bias


class _LabelLogprobs(torch.autograd.Function):
    """Thin autograd wrapper: only the scored tokens' indices, labels and log-sum-exp are saved."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        plan: TilePlan,
    ) -> torch.Tensor:
        columns = labels.unsqueeze(1) if labels.dim() == 1 else labels  # [T, K]; K = 1 for [T] labels
        entry = columns != ignore_index
        scored = entry.any(dim=1).nonzero().squeeze(1)  # [S] rows with at least one scored label
        targets = torch.where(entry, columns, 0).index_select(0, scored).long()
        lse, label_logit = forward_tiles(hidden, weight, bias, scored, targets, plan)
        out = torch.zeros(columns.shape, dtype=lse.dtype, device=hidden.device)
        out.index_copy_(0, scored, label_logit - lse.unsqueeze(1))
        out = torch.where(entry, out, 0.0)
        ctx.save_for_backward(hidden, weight, bias, scored, targets, lse, entry)
        ctx.plan = plan
        ctx.label_shape = labels.shape
        return out.reshape(labels.shape)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, scored, targets, lse, entry = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        grad = torch.where(entry, grad_out.reshape(entry.shape), 0.0)
        grads = backward_tiles(grad, hidden, weight, bias, scored, targets, lse, ctx.plan, need=need)
        return (*grads, None, None, None)


def label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T + bias)[t, labels[t]]`` per token (per label), in tiles (no [T, V] tensor).

    Same contract and values as :func:`reference_label_logprobs`; forward and backward recompute the
    logits tile by tile (see :func:`plan_tiles` for the tile shape).

    Args:
        hidden: [T, D] float32 / bfloat16 / float16 / float64, the tokens on this rank in any layout
            (full row, zigzag or contiguous shard: the head is per token and talks over no group).
        weight: [V, D], same dtype family (the LM head, or the tied embedding matrix); bias: optional [V].
        labels: integer [T], or [T, K] for K candidate labels per token (each tile's logits serve all K);
            ``ignore_index`` marks an unscored entry (log-prob 0, no gradient).
        chunk_tokens / chunk_vocab: explicit tile shape; by default picked from ``max_chunk_bytes``.
        max_chunk_bytes: budget of the logits tile (and of a float32 block of a bf16 weight).
    Returns:
        log-probs of ``labels``' shape, float32 (float64 for float64 input). Differentiable in hidden, weight and bias;
        their gradients come back in their own dtypes, accumulated in float32 (float64) first.
        Memory beyond inputs and gradients: one logits tile and [S] log-sum-exps (S scored tokens); for a
        bf16 weight also its float32 block and that block's d_weight accumulator (each within the budget),
        and for bf16 hidden a float32 [T, D] d_hidden accumulator during the backward.
        The label range check reads two scalars back from the device (one sync).
    Raises:
        UserInputError (a ValueError) if a label other than ``ignore_index`` lies outside [0, V);
        ValueError for bad shapes or chunk sizes.
    """
    _check_inputs(hidden, weight, labels, bias, ignore_index)
    plan = plan_tiles(
        hidden, weight, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, max_chunk_bytes=max_chunk_bytes
    )
    return _LabelLogprobs.apply(hidden, weight, bias, labels, ignore_index, plan)
