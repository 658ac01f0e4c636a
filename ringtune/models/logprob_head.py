"""The log-prob head: ``log_softmax(hidden @ weight.T + bias)[t, labels[t]]`` without a [T, V] logits tensor.

Full fine-tuning at long context cannot afford the logits: 32K tokens × a 248K vocabulary is 30 GiB in
float32, and autograd would keep it (and its softmax) for the backward. :func:`label_logprobs` walks
tiles of the logits instead, each held vocabulary-major ([vocab block, tokens], :func:`_tile_logits`):

- forward: per tile, the logits in float32 (float64 for float64 input), their log-sum-exp merged into a
  running one per token, and the label's logit; it keeps only the log-sum-exp of each scored token;
- backward: per tile, the logits again, ``p = (onehot(label) - softmax) · g`` (the gradient of a
  log-prob; a loss ``-logprob`` makes it the familiar ``softmax - onehot``), then
  ``d_hidden += pᵀ @ weight`` and ``d_weight += p @ hidden`` (``d_bias += Σ_t p``), with ``p`` left unformed:
  the tile's exps made in cache-sized blocks, the softmax's per-token scale and the one-hot part applied on
  the [tokens, D] side (:mod:`ringtune.models.logprob_tile_grads`);
- one pass (``upstream``): when the caller knows ``g`` before the forward (cross_entropy: ``g = -weights``),
  the forward forms ``p`` from the same logits and accumulates the gradients there; the backward hands them
  over (one logits computation per tile instead of two).

The tile shape (:mod:`ringtune.models.logprob_tiles`) follows the rank's own token count, with a floor and a
256 MiB cap; the vocabulary is split only when one token's logits (or a bf16 weight's float block) exceed it.
Tokens whose label is ``ignore_index`` are skipped (log-prob 0, no gradient). ``weight`` may be a tied
embedding matrix: autograd adds the head's ``d_weight`` to the embedding's gradient as for any reuse.
"""

from __future__ import annotations

import torch

from ringtune.errors import UserInputError
from ringtune.models.logprob_tile_grads import TileGradient, TileGrads, exp_blocks
from ringtune.models.logprob_tiles import DEFAULT_MAX_CHUNK_BYTES, TilePlan, accumulator_dtype, plan_tiles, spans
from ringtune.ops.linear import product, product_kernel

IGNORE_INDEX = -100
"""The label of a position that is not scored (pads, each sequence's last token): log-prob 0, no gradient.

The same value as ``torch.nn.functional.cross_entropy``'s default; every caller reads it from here.
"""


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
    ignore_index: int = IGNORE_INDEX,
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


def _tile_logits(
    h_tile: torch.Tensor, w_block: torch.Tensor, b_block: torch.Tensor | None, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """[vocab, tokens] logits of one tile in the accumulator dtype (inputs already cast), vocabulary-major.

    Vocabulary-major because the large operand (the weight block) is then the row-major left factor of all
    three products of a tile (``w @ hᵀ``, ``pᵀ @ w`` as ``(p)ᵀ``'s rows, ``p @ h``): measured 10-15% faster
    than token-major on one CPU thread (``benchmarks/long_rows_cp.py`` figure C), the same on a GPU.
    The product's kernel is :func:`ringtune.ops.linear.product`'s choice (oneDNN for float32 on a CPU, with the
    tile's tokens as its small operand). ``buffer``: a flat tensor of at least vocab × tokens elements
    (:func:`_tile_buffer`) an ``aten`` product writes the logits into; None: a new tensor.
    """
    rows, cols = w_block.shape[0], h_tile.shape[0]
    logits = product(w_block, h_tile, None if buffer is None else buffer[: rows * cols].view(rows, cols))
    if b_block is not None:
        logits.add_(b_block.unsqueeze(1))
    return logits


def _label_columns(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the vocab block [start, start + width): each label's column (clamped) and whether it lies inside."""
    local = labels - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


def _tile_buffer(
    plan: TilePlan, hidden: torch.Tensor, weight: torch.Tensor, tokens: int, like: torch.Tensor
) -> torch.Tensor | None:
    """One flat buffer, of ``like``'s dtype and device, for the logits of every tile of a pass over ``tokens``
    scored rows of ``hidden`` and ``weight``'s rows: the largest tile's elements, allocated once per pass; None
    when no tile product would write into it (none, or oneDNN's, which returns its own tensor).

    A tile of a rank of T tokens is 4 × T × D accumulator bytes (:mod:`~ringtune.models.logprob_tiles`), often
    over glibc's 32 MiB mmap threshold: a new tensor per tile was a fresh mapping whose pages the product
    faulted in each time (the memory bound is the same: one tile at a time, as before). oneDNN's product is
    a new tensor per tile anyway, and still came out ahead (the head of an 8184-token row 2.64 s against
    2.79 s with MKL into the buffer).
    """
    probe_h, probe_w = hidden[:0].to(like.dtype), weight[:0].to(like.dtype)  # the tiles' operand types
    if tokens == 0 or product_kernel(probe_w, probe_h) == "onednn":
        return None
    return like.new_empty(min(plan.tokens, tokens) * min(plan.vocab, weight.shape[0]))


def _forward_tile(
    h_tile: torch.Tensor,
    w_block: torch.Tensor,
    b_block: torch.Tensor | None,
    targets: torch.Tensor,
    v0: int,
    g: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
    hidden_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, TileGradient | None]:
    """One tile's (log-sum-exp over its vocab block [tokens], label logits or 0 if outside it [tokens, K], gradient).

    The gradient is None unless ``g`` [tokens, K] (the upstream gradient) is given, in which case the block must
    be the whole vocabulary: then it is ``Σ_k (onehot_k - softmax) · g_k`` as a :class:`TileGradient` over the
    tile's exps (softmax as ``exp(l - max) / Σ exp(l - max)``, the normalisation on the tokens' side), with
    ``eᵀ W`` made in the exp pass when ``hidden_grad``. The logits live in ``buffer`` when given
    (:func:`_tile_logits`). A function of its own so that the [vocab, tokens] logits are freed on return.
    """
    logits = _tile_logits(h_tile, w_block, b_block, buffer)
    cols, inside = _label_columns(targets, v0, w_block.shape[0])
    label_logit = torch.where(inside, logits.gather(0, cols.T).T, 0.0)
    col_max = logits.amax(dim=0)
    col_max = torch.where(torch.isfinite(col_max), col_max, 0.0)  # a block masked to -inf by the bias
    sum_exp, e_t_w = exp_blocks(logits, col_max, w_block if g is not None and hidden_grad else None)
    block_lse = col_max + sum_exp.log()
    if g is None:
        return block_lse, label_logit, None
    return (
        block_lse,
        label_logit,
        TileGradient(logits, -g.sum(dim=1) / sum_exp, cols, torch.where(inside, g, 0.0), e_t_w),
    )


def forward_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scored: torch.Tensor,
    targets: torch.Tensor,
    plan: TilePlan,
    g: torch.Tensor | None = None,
    need: tuple[bool, bool, bool] = (False, False, False),
) -> tuple[torch.Tensor, torch.Tensor, TileGrads | None]:
    """Log-sum-exp [S] and label logits [S, K] of the S tokens ``hidden[scored]`` (labels ``targets`` [S, K]).

    Accumulator dtype throughout; vocab blocks are merged by ``logaddexp``. With ``g`` [S, K] (the upstream
    gradient of the scored rows; needs ``plan.spans_vocab``) the gradients ``need`` asks for are accumulated
    in the same pass and returned as a :class:`TileGrads` (else None).
    """
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    n = scored.numel()
    if g is not None and not plan.spans_vocab(weight.shape[0]):
        raise ValueError(f"one-pass gradients need tiles over the whole vocabulary; got {plan}")
    grads = None if g is None else TileGrads(hidden, weight, bias, need)
    lse = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
    label_logit = torch.zeros(targets.shape, dtype=acc, device=hidden.device)
    buffer = _tile_buffer(plan, hidden, weight, n, lse)
    for v0, v1 in spans(weight.shape[0] if n else 0, plan.vocab):
        w_block = weight[v0:v1].to(acc)
        b_block = None if bias is None else bias[v0:v1].to(acc)
        if grads is not None:
            grads.open_block(v0, v1, w_block)
        for t0, t1 in spans(n, plan.tokens):
            rows = scored[t0:t1]
            h_tile = hidden.index_select(0, rows).to(acc)
            g_tile = None if g is None else g[t0:t1]
            block_lse, block_label, tile = _forward_tile(
                h_tile, w_block, b_block, targets[t0:t1], v0, g_tile, buffer, need[0]
            )
            torch.logaddexp(lse[t0:t1], block_lse, out=lse[t0:t1])
            label_logit[t0:t1] += block_label
            if grads is not None and tile is not None:
                grads.add(rows, tile, h_tile, w_block)
            del tile  # its exps are a view of the tile buffer, which the next tile overwrites
        if grads is not None:
            grads.close_block(v0, v1)
    return lse, label_logit, grads


def _backward_tile(
    grads: TileGrads,
    rows: torch.Tensor,
    h_tile: torch.Tensor,
    w_block: torch.Tensor,
    b_block: torch.Tensor | None,
    targets: torch.Tensor,
    v0: int,
    lse: torch.Tensor,
    g: torch.Tensor,
    buffer: torch.Tensor | None = None,
) -> None:
    """Add to ``grads`` one tile's d logprobs / d logits times the upstream gradient, ``Σ_k (onehot_k - softmax) · g_k``
    (softmax as ``exp(l - lse)``: its scale is known before the exps, so exps and products take one walk,
    :meth:`TileGrads.add_with_exps`). ``targets`` and ``g`` are [tokens, K]; the logits [vocab, tokens]
    (vocabulary-major, as :func:`_tile_logits`) live in ``buffer`` when given.
    """
    logits = _tile_logits(h_tile, w_block, b_block, buffer)
    cols, inside = _label_columns(targets, v0, w_block.shape[0])
    tile = TileGradient(logits, -g.sum(dim=1), cols, torch.where(inside, g, 0.0), None)
    grads.add_with_exps(rows, lse, tile, h_tile, w_block)


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
    rows take part; ``targets`` [S, K]. Recomputes every logits tile (see :class:`TileGrads` for dtypes).
    """
    acc = accumulator_dtype(hidden.dtype, weight.dtype)
    n = scored.numel()
    g = grad_out.to(acc).index_select(0, scored)
    grads = TileGrads(hidden, weight, bias, need)
    buffer = _tile_buffer(plan, hidden, weight, n, lse)
    for v0, v1 in spans(weight.shape[0] if n else 0, plan.vocab):
        w_block = weight[v0:v1].to(acc)
        b_block = None if bias is None else bias[v0:v1].to(acc)
        grads.open_block(v0, v1, w_block)
        for t0, t1 in spans(n, plan.tokens):
            rows = scored[t0:t1]
            h_tile = hidden.index_select(0, rows).to(acc)
            _backward_tile(grads, rows, h_tile, w_block, b_block, targets[t0:t1], v0, lse[t0:t1], g[t0:t1], buffer)
        grads.close_block(v0, v1)
    return grads.result()


def takes_one_pass(plan: TilePlan, weight: torch.Tensor, upstream: torch.Tensor | None, need: tuple[bool, ...]) -> bool:
    """Whether the forward also makes the gradients (the one place this is decided).

    Yes when the caller knows the upstream gradient before the forward (``upstream``), autograd will want a
    gradient (grad mode on and an input that requires one), and each tile spans the whole vocabulary (a tile
    must know its tokens' log-sum-exp to form the softmax). Otherwise the backward recomputes the logits.
    """
    return upstream is not None and torch.is_grad_enabled() and any(need) and plan.spans_vocab(weight.shape[0])


class _LabelLogprobs(torch.autograd.Function):
    """Thin autograd wrapper: only the scored tokens' indices, labels and log-sum-exp are saved.

    With ``upstream`` (the one-pass path) the forward also keeps the gradients it made for that upstream
    gradient; the backward returns them when the gradient it receives equals it (``torch.equal`` on the
    scored entries), and otherwise recomputes, so a caller's wrong guess costs time, never correctness.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        plan: TilePlan,
        upstream: torch.Tensor | None,
        need: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        columns = labels.unsqueeze(1) if labels.dim() == 1 else labels  # [T, K]; K = 1 for [T] labels
        entry = columns != ignore_index
        scored = entry.any(dim=1).nonzero().squeeze(1)  # [S] rows with at least one scored label
        targets = torch.where(entry, columns, 0).index_select(0, scored).long()
        acc = accumulator_dtype(hidden.dtype, weight.dtype)
        expected = g = None
        if upstream is not None:
            expected = torch.where(entry, upstream.reshape(entry.shape).to(acc), 0.0)
            g = expected.index_select(0, scored)
        lse, label_logit, grads = forward_tiles(hidden, weight, bias, scored, targets, plan, g, need)
        out = torch.zeros(columns.shape, dtype=lse.dtype, device=hidden.device)
        out.index_copy_(0, scored, label_logit - lse.unsqueeze(1))
        out = torch.where(entry, out, 0.0)
        ctx.save_for_backward(hidden, weight, bias, scored, targets, lse, entry)
        ctx.plan = plan
        ctx.early = None if grads is None else (expected, grads.result())
        return out.reshape(labels.shape)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, scored, targets, lse, entry = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        grad = torch.where(entry, grad_out.reshape(entry.shape), 0.0)
        early, ctx.early = ctx.early, None  # one use: the buffers are freed with it
        if early is not None and torch.equal(grad, early[0]):
            grads = tuple(x if wanted else None for x, wanted in zip(early[1], need, strict=True))
        else:
            grads = backward_tiles(grad, hidden, weight, bias, scored, targets, lse, ctx.plan, need=need)
        return (*grads, None, None, None, None, None)


def label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    upstream: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T + bias)[t, labels[t]]`` per token (per label), in tiles (no [T, V] tensor).

    Same contract and values as :func:`reference_label_logprobs`; forward and backward recompute the
    logits tile by tile (see :mod:`ringtune.models.logprob_tiles` for the tile shape), or, with ``upstream``,
    the forward computes them once and makes the gradients in the same pass (:func:`takes_one_pass`).

    Args:
        hidden: [T, D] float32 / bfloat16 / float16 / float64, the tokens on this rank in any layout
            (full row, zigzag or contiguous shard: the head is per token and talks over no group).
        weight: [V, D], same dtype family (the LM head, or the tied embedding matrix); bias: optional [V].
        labels: integer [T], or [T, K] for K candidate labels per token (each tile's logits serve all K);
            ``ignore_index`` marks an unscored entry (log-prob 0, no gradient).
        chunk_tokens / chunk_vocab: explicit tile shape; by default sized from T (this rank's tokens),
            capped by ``max_chunk_bytes``.
        max_chunk_bytes: cap of the logits tile (and of a float32 block of a bf16 weight).
        upstream: labels' shape, any float dtype, or None: the gradient the caller will send back for the
            output (d loss / d logprobs), when it is known before the forward (a loss linear in the
            log-probs with fixed coefficients, e.g. cross_entropy with given weights). The backward uses the
            forward's gradients only if the gradient it receives equals ``upstream`` (cast to the output dtype)
            on the scored entries; otherwise it recomputes as without ``upstream``.
    Returns:
        log-probs of ``labels``' shape, float32 (float64 for float64 input). Differentiable in hidden, weight and bias;
        their gradients come back in their own dtypes, accumulated in float32 (float64) first. One-pass
        gradients equal the two-pass ones up to rounding (softmax as ``e / Σe`` instead of ``exp(l - lse)``).
        Memory beyond inputs and gradients: one logits tile and [S] log-sum-exps (S scored tokens); for a
        bf16 weight also its float32 block and that block's d_weight accumulator (each within the cap),
        and for bf16 hidden a float32 [T, D] d_hidden accumulator during the backward. The one-pass path
        holds d_hidden [T, D] and d_weight [V, D] (and d_bias) from the forward until the backward.
        The label range check reads two scalars back from the device (one sync).
    Raises:
        UserInputError (a ValueError) if a label other than ``ignore_index`` lies outside [0, V);
        ValueError for bad shapes or chunk sizes, or an ``upstream`` not of labels' shape.
    """
    _check_inputs(hidden, weight, labels, bias, ignore_index)
    if upstream is not None and upstream.shape != labels.shape:
        raise ValueError(f"upstream must have labels' shape {tuple(labels.shape)}; got {tuple(upstream.shape)}")
    plan = plan_tiles(
        hidden, weight, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, max_chunk_bytes=max_chunk_bytes
    )
    need = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if not takes_one_pass(plan, weight, upstream, need):
        upstream = None
    return _LabelLogprobs.apply(hidden, weight, bias, labels, ignore_index, plan, upstream, need)
