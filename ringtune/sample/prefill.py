"""Prefill: prompts through the training forward (one packed row at CP = 1), caches and prompt log-probs out.

A group of prompts is packed into one THD row and run by :meth:`CausalLM.hidden_states` with the row's
:class:`PackedShard` and a :class:`PrefillCapture`, so a long prompt goes through exactly the code (and the
memory behaviour) of a training forward. From the final hidden states:

- the logits of each prompt's last token (the first sampled token's distribution);
- ``prompt_logprobs``: ``log p(prompt[i] | prompt[:i])`` for i ≥ 1 by the training log-prob head
  (:func:`label_logprobs`, i.e. what :meth:`CausalLM.forward` returns); entry 0 is None;
- ``topk_prompt_logprobs``: the k most likely tokens and their log-probs at every prompt position i ≥ 1
  (the distribution the model predicts for position i), computed in tiles of tokens; entry 0 is None;
- ``target_logprobs`` (Tinker's ``target_prompt_logprobs``): for a prompt of n tokens and targets
  [n−1, K] of token ids, ``log p(targets[i, j] | prompt[:i+1])`` [n−1, K] by the training head's [T, K]
  labels (one logits pass for all K); a target of −1 asks for nothing and gets 0.0;
- ``prompt_alt_tokens`` (Tinker's ``prompt_alt_tokens_k``): k draws per prompt position i ≥ 1 from the model's
  distribution at the request's temperature, with their log-probs (:mod:`ringtune.sample.alt_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ringtune.layout import zigzag_slice
from ringtune.models.cache import PrefillCapture, SequenceCache
from ringtune.models.decoder import CausalLM
from ringtune.models.image_input import ImageInput
from ringtune.models.logprob_head import IGNORE_INDEX, label_logprobs
from ringtune.models.shard import shard_of
from ringtune.sample.alt_tokens import AltDraws, AltTokens, draw_alt_tokens, row_uniforms, split_rows

IGNORE = IGNORE_INDEX
"""The head's label for a position that is not scored (each prompt's last token, pads, a -1 target)."""

TOPK_TILE_BYTES = 64 * 1024 * 1024
"""Byte budget of one tile of float32 logits when computing top-k prompt log-probs."""


@dataclass
class PrefillResult:
    """What one prefill row gives, per prompt in order."""

    last_logits: torch.Tensor  # [n, V], float32 (float64 for a float64 model)
    caches: list[SequenceCache]
    prompt_logprobs: list[list[float | None]] | None
    topk_prompt_logprobs: list[list[list[tuple[int, float]] | None]] | None
    target_logprobs: list[torch.Tensor] | None = None  # per prompt [n−1, K] float32 (float64), CPU
    prompt_alt_tokens: list[AltTokens] | None = None  # per prompt (ids [n−1, k], log-probs [n−1, k]), CPU


def output_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [n, D] @ weight [V, D]ᵀ in float32 (float64 for float64): the logits decoding samples from."""
    acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    return hidden.to(acc) @ weight.to(acc).t()


def topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``log_softmax(hidden @ weight.T)`` per row, in tiles of rows (never [T × V] at once).

    Returns ``(ids int64 [T, k], logprobs [T, k])``, most likely first.
    """
    T, V = hidden.shape[0], weight.shape[0]
    rows = max(1, TOPK_TILE_BYTES // (4 * V))
    ids, lps = [], []
    for start in range(0, T, rows):
        lp = torch.log_softmax(output_logits(hidden[start : start + rows], weight), dim=-1)
        top = lp.topk(k, dim=-1)
        ids.append(top.indices)
        lps.append(top.values)
    if not ids:
        return hidden.new_zeros(0, k, dtype=torch.int64), hidden.new_zeros(0, k)
    return torch.cat(ids), torch.cat(lps)


def target_labels(targets: torch.Tensor) -> torch.Tensor:
    """Tinker targets [n−1, K] (−1 = none) -> head labels [n, K]: row i scores position i+1 from the hidden
    state of position i, so the prompt's last position gets none; −1 becomes the head's ignore label."""
    labels = torch.where(targets < 0, IGNORE, targets)
    return torch.cat([labels, torch.full((1, targets.shape[1]), IGNORE, dtype=torch.int64, device=targets.device)])


def prefill(
    model: CausalLM,
    prompts: list[list[int]],
    *,
    prompt_logprobs: bool = False,
    topk: int = 0,
    targets: list[torch.Tensor] | None = None,
    alt: AltDraws | None = None,
    images: Sequence[Sequence[ImageInput]] | None = None,
) -> PrefillResult:
    """Run ``prompts`` (each at least one token) as one packed row; see the module docstring.

    ``targets``: one int64 [n−1, K] per prompt (the same K for all), or None. ``alt``: the prompt alt-token
    draws to make (one seed per prompt), or None. ``images``: per prompt, its images (a VL model; their pad
    tokens are in the prompt): they go through the vision tower, the prompt through MRoPE positions, and each
    cache's ``rope_offset`` makes decoding continue the prompt's position count.
    Must run under ``torch.inference_mode()`` (or ``no_grad``) for sampling; single process.
    """
    lens = [len(p) for p in prompts]
    vision = model.config.vision
    merge = vision.spatial_merge_size if vision is not None else 2
    shard = shard_of(lens, images=images, spatial_merge_size=merge)
    if shard.images is not None:
        shard = replace(shard, images=shard.images.to(model.output_weight.device))
    plan = shard.plan
    device = model.output_weight.device
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    capture = PrefillCapture(plan, len(model.model.layers))
    hidden = model.hidden_states(zigzag_slice(flat, plan), shard, capture=capture)
    weight = model.output_weight
    starts = plan.local_starts
    last = torch.tensor([s + n - 1 for s, n in zip(starts, lens, strict=True)], dtype=torch.int64, device=device)
    plps = tops = alts = None
    draw_rows = torch.tensor(
        [i for s, n in zip(starts, lens, strict=True) for i in range(s, s + n - 1)], dtype=torch.int64, device=device
    )
    if prompt_logprobs:
        labels = torch.full((plan.local_len,), IGNORE, dtype=torch.int64, device=device)
        for s, p in zip(starts, prompts, strict=True):
            labels[s : s + len(p) - 1] = torch.tensor(p[1:], dtype=torch.int64, device=device)
        lp = label_logprobs(hidden, weight, labels).tolist()
        plps = [[None, *lp[s : s + n - 1]] for s, n in zip(starts, lens, strict=True)]
    if topk:
        ids, lps = topk_logprobs(hidden[draw_rows], weight, topk)
        ids_l, lps_l = ids.tolist(), lps.tolist()
        tops, at = [], 0
        for n in lens:
            rows = [list(zip(ids_l[at + j], lps_l[at + j], strict=True)) for j in range(n - 1)]
            tops.append([None, *rows])
            at += n - 1
    target_lps = None
    if targets is not None:
        labels = torch.full(
            (plan.local_len, targets[0].shape[1]), IGNORE, dtype=torch.int64, device="cpu"
        )  # moved below
        for s, n, t in zip(starts, lens, targets, strict=True):
            labels[s : s + n] = target_labels(t)
        lp = label_logprobs(hidden, weight, labels.to(device)).cpu()
        target_lps = [lp[s : s + n - 1] for s, n in zip(starts, lens, strict=True)]
    if alt is not None:
        uniforms = zigzag_slice(row_uniforms(lens, alt.seeds, alt.k), plan).to(device)[draw_rows]
        alts = split_rows(*draw_alt_tokens(hidden[draw_rows], weight, uniforms, alt.temperature), lens)
    return PrefillResult(output_logits(hidden[last], weight), capture.sequences(), plps, tops, target_lps, alts)
