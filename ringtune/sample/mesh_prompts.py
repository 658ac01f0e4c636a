"""Long prompts through the context-parallel forward: prompt log-probs, first-token logits, decode caches.

:func:`prompts_forward` runs the prompts of long sampling requests exactly as the trainer's ``forward``
runs datums: packed into rows within the per-rank token budget
(:func:`ringtune.engine.packing.pack_datums`), rows spread over the DP ranks, each row split over the CP
group in the zigzag layout and run by :meth:`CausalLM.hidden_states` with the server's CP modes. So a
128K-token prompt costs each rank ``T/CP`` tokens of the forward, as in training. From each rank's final
hidden states:

- ``prompt_logprobs``: ``log p(prompt[i] | prompt[:i])`` for i ≥ 1 by the training head
  (:func:`label_logprobs`), zero-padded to the row and summed over CP (:func:`gather_row`; each token has
  one owner, so the sum is exact); entry 0 is None;
- ``topk_prompt_logprobs``: the k most likely tokens per position on the rank that owns it, gathered the
  same way (ids travel as float64, exact below 2**53);
- ``target_logprobs`` (Tinker's ``target_prompt_logprobs``: K ids per position) by the head's [T, K]
  labels, gathered the same way;
- ``prompt_alt_tokens`` (Tinker's ``prompt_alt_tokens_k``): k draws per position on the rank that owns it, each
  with the uniforms of its row of the prompt (:func:`~ringtune.sample.alt_tokens.row_uniforms`, sliced like the
  tokens), so the draws are those of the one-rank prefill; gathered the same way;
- the hidden state of each prompt's last token (one owner; summed over CP), turned into float32 (float64)
  logits on the rank that decodes the prompt: the distribution of the first sampled token;
- with ``capture`` (requests that generate more than one token), each layer's decode cache, gathered over
  the CP group by a :class:`~ringtune.models.cache.PrefillCapture` and kept by the decoding rank only.

Each prompt is decoded by one rank: the prompt at position g of a row goes to CP rank ``g mod CP`` of the
DP rank that ran the row (:func:`decoding_rank`), so the prompts of a command spread over the whole mesh.
:func:`prompts_forward` returns, on every rank, the :class:`PromptForward` of the prompts it decodes; the
caller decodes them (``generate(..., prefilled=...)``) and collects the results. Which requests take this
path is decided in one place, :func:`takes_mesh_forward`: a prompt of at least ``min_prompt_tokens`` tokens
(the server's ``--mesh-prompt-tokens``; by default the per-rank token budget, i.e. a prompt longer than what
one rank holds of a training row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtune.engine.packing import pack_datums
from ringtune.layout.zigzag import ZigzagPlan, zigzag_slice
from ringtune.models.cache import PrefillCapture, SequenceCache
from ringtune.models.decoder import CausalLM
from ringtune.models.image_input import ImageInput
from ringtune.models.logprob_head import label_logprobs
from ringtune.models.shard import PackedShard, shard_of, with_images
from ringtune.parallel.collectives import all_reduce_
from ringtune.parallel.mesh import ParallelMesh
from ringtune.parallel.row_gather import gather_row
from ringtune.sample.alt_tokens import AltDraws, AltTokens, draw_alt_tokens, row_uniforms
from ringtune.sample.prefill import IGNORE, output_logits, target_labels, topk_logprobs

TopK = list[list[tuple[int, float]] | None]


@dataclass(frozen=True)
class PromptForward:
    """One prompt's forward: ``last_logits`` [V] (float32, float64 for a float64 model), the prompt log-probs
    (entry 0 None) and top-k prompt log-probs (entry 0 None) when asked, its decode cache when captured."""

    last_logits: torch.Tensor
    prompt_logprobs: list[float | None] | None
    topk_prompt_logprobs: TopK | None
    cache: SequenceCache | None = None
    target_logprobs: torch.Tensor | None = None  # [n−1, K] for targets [n−1, K] (0.0 where the target is −1)
    prompt_alt_tokens: AltTokens | None = None  # (ids [n−1, k], log-probs [n−1, k]) when asked


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """How the prompts are laid out: the trainer's budget, pad multiple and CP modes."""

    max_tokens_per_rank: int
    attention: str
    gated_delta: str
    pad_multiplier: int = 8


def takes_mesh_forward(prompt_len: int, *, min_prompt_tokens: int) -> bool:
    """Whether a sampling request's prompt runs through :func:`prompts_forward` (the whole mesh) rather than
    a prefill on the rank that decodes it: its prompt is long."""
    return prompt_len >= min_prompt_tokens


def decoding_rank(position: int, cp_size: int) -> int:
    """The CP rank that decodes the prompt at ``position`` of its row (the DP rank is the row's)."""
    return position % cp_size


def _coords(mesh: ParallelMesh | None) -> tuple[int, int, int, int]:
    return (mesh.dp_size, mesh.dp_rank, mesh.cp_size, mesh.cp_rank) if mesh else (1, 0, 1, 0)


def prompts_forward(
    model: CausalLM,
    mesh: ParallelMesh | None,
    prompts: Sequence[Sequence[int]],
    layout: MeshLayout,
    *,
    prompt_logprobs: bool,
    topk: int = 0,
    capture: bool = False,
    targets: Sequence[torch.Tensor] | None = None,
    alt: AltDraws | None = None,
    images: Sequence[Sequence[ImageInput]] | None = None,
) -> dict[int, PromptForward]:
    """Run ``prompts`` (validated token lists, each ≥ 1 token) through the DP×CP forward; see the module doc.
    ``images``: per prompt, its images (a VL model: each CP rank encodes those it holds tokens of, positions
    are the sequences' MRoPE; docs/vision.md), or None.

    Every rank of ``mesh`` calls it with the same arguments and an identical ``model`` (collective over the
    CP groups). Returns ``{prompt index: PromptForward}`` of the prompts this rank decodes
    (:func:`decoding_rank`); with ``capture`` each carries its decode cache; ``targets`` (one int64
    [n−1, K] per prompt, the same K) adds their log-probs; ``alt`` (one seed per prompt, the same on every
    rank) adds the prompt alt-token draws. Raises UserInputError (before
    any collective, on every rank alike) when a prompt does not fit the per-rank budget at this CP size.
    """
    dp_size, dp_rank, cp_size, cp_rank = _coords(mesh)
    lens = [len(p) for p in prompts]
    packing = pack_datums(
        lens,
        dp_size=dp_size,
        cp_size=cp_size,
        max_tokens_per_rank=layout.max_tokens_per_rank,
        pad_multiplier=layout.pad_multiplier,
    )
    mine: dict[int, PromptForward] = {}
    with torch.no_grad():
        for row, local_len in zip(packing.rows[dp_rank], packing.local_lens[dp_rank], strict=True):
            members = [list(prompts[i]) for i in row]
            shard = shard_of(
                [len(p) for p in members],
                cp_size=cp_size,
                cp_rank=cp_rank,
                group=mesh.cp_group if mesh else None,
                attention=layout.attention,
                gated_delta=layout.gated_delta,
                pad_multiplier=layout.pad_multiplier,
                pad_to=local_len,
            )
            if images is not None and any(images[i] for i in row):
                merge = model.config.vision.spatial_merge_size if model.config.vision is not None else 2
                device = model.output_weight.device
                shard = with_images(shard, [images[i] for i in row], merge, device)
            keep = {g for g in range(len(row)) if decoding_rank(g, cp_size) == cp_rank}
            row_targets = [targets[i] for i in row] if targets is not None else None
            results = _row_forward(
                model,
                members,
                shard,
                keep,
                prompt_logprobs=prompt_logprobs,
                topk=topk,
                capture=capture,
                targets=row_targets,
                alt=alt.for_prompts(row) if alt is not None else None,
            )
            mine.update((row[g], result) for g, result in results.items())
    return mine


def _labels(members: list[list[int]]) -> torch.Tensor:
    """int64 [row_len]: each prompt's next tokens, IGNORE at each prompt's last token."""
    parts = [torch.tensor([*p[1:], IGNORE], dtype=torch.int64, device="cpu") for p in members]
    return torch.cat([torch.zeros(0, dtype=torch.int64, device="cpu"), *parts])  # host: zigzag-sliced, then moved


def _last_rows(plan: ZigzagPlan) -> torch.Tensor:
    """int64 [n_seq]: the row index of every sequence's last token."""
    return torch.tensor(
        [s + n - 1 for s, n in zip(plan.row_starts, plan.seq_lens, strict=True)], dtype=torch.int64, device="cpu"
    )


def _gather_pairs(
    ids: torch.Tensor, values: torch.Tensor, plan: ZigzagPlan, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (ids [n_real, k], values [n_real, k]) of this rank's real tokens -> the whole row's (int64
    [row_len, k], float64 [row_len, k]), identical on every rank: one :func:`gather_row` of both, the ids
    travelling as float64 (exact below 2**53)."""
    local = ids.new_zeros((plan.local_len, 2, ids.shape[-1]), dtype=torch.float64)
    local[plan.is_real.to(ids.device)] = torch.stack([ids.to(torch.float64), values.to(torch.float64)], dim=1)
    full = gather_row(local, plan, group)
    return full[:, 0].round().to(torch.int64), full[:, 1]


def _row_forward(
    model: CausalLM,
    members: list[list[int]],
    shard: PackedShard,
    keep: set[int],
    *,
    prompt_logprobs: bool,
    topk: int,
    capture: bool,
    targets: list[torch.Tensor] | None = None,
    alt: AltDraws | None = None,
) -> dict[int, PromptForward]:
    """One packed row (possibly pad-only) on this CP rank; the results of the row positions in ``keep``.

    Collectives over ``shard.group``, the same sequence on every rank: the model's (with the capture's
    gathers), then one all-reduce per gathered quantity (last hidden states; log-probs if asked; top-k ids
    and log-probs if asked; target log-probs if asked; alt-token ids and log-probs if asked).
    """
    plan, group = shard.plan, shard.group
    device = model.output_weight.device
    host = [torch.tensor(p, dtype=torch.int64, device="cpu") for p in members]  # zigzag-sliced on the host, then moved
    flat = torch.cat([torch.zeros(0, dtype=torch.int64, device="cpu"), *host])
    layers = len(model.model.layers)
    caught = PrefillCapture(plan, layers, group=group, keep=keep) if capture else None
    hidden = model.hidden_states(zigzag_slice(flat, plan).to(device), shard, capture=caught)
    caches = caught.sequences() if caught is not None else [None] * len(members)
    weight = model.output_weight
    acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32

    last = _last_rows(plan)
    owned = torch.isin(plan.row_index, last)
    last_hidden = hidden.new_zeros((len(members), hidden.shape[-1]), dtype=acc)
    slot = torch.searchsorted(last, plan.row_index[owned])
    last_hidden[slot.to(device)] = hidden[owned.to(device)].to(acc)
    if group is not None and plan.cp_size > 1:
        all_reduce_(last_hidden, group)

    lps: list[float] | None = None
    if prompt_logprobs:
        labels = zigzag_slice(_labels(members), plan, pad_value=IGNORE).to(device)
        lps = gather_row(label_logprobs(hidden, weight, labels).to(acc), plan, group).tolist()
    real = plan.is_real.to(device)
    tops: tuple[list[list[int]], list[list[float]]] | None = None
    if topk:
        ids, values = _gather_pairs(*topk_logprobs(hidden[real], weight, topk), plan, group)
        tops = (ids.tolist(), values.tolist())

    target_lps: torch.Tensor | None = None
    if targets is not None:
        k = targets[0].shape[1] if targets else 1  # a pad-only row still joins the gather, with any K
        rows = [target_labels(t) for t in targets]
        labels = torch.cat(
            [torch.zeros((0, k), dtype=torch.int64, device="cpu"), *rows]
        )  # sliced on the host, then moved
        local = zigzag_slice(labels, plan, pad_value=IGNORE).to(device)
        target_lps = gather_row(label_logprobs(hidden, weight, local).to(acc), plan, group).cpu()

    alts: tuple[torch.Tensor, torch.Tensor] | None = None
    if alt is not None:
        uniforms = zigzag_slice(row_uniforms([len(p) for p in members], alt.seeds, alt.k), plan).to(device)
        drawn = draw_alt_tokens(hidden[real], weight, uniforms[real], alt.temperature)
        alts = tuple(x.cpu() for x in _gather_pairs(*drawn, plan, group))  # type: ignore[assignment]

    out = {}
    for g, (start, n) in enumerate(zip(plan.row_starts, plan.seq_lens, strict=True)):
        if g not in keep:
            continue
        plp = [None, *lps[start : start + n - 1]] if lps is not None else None
        ptop: TopK | None = None
        if tops is not None:
            ids_l, values_l = tops
            ptop = [None] + [list(zip(ids_l[t], values_l[t], strict=True)) for t in range(start, start + n - 1)]
        tlp = target_lps[start : start + n - 1] if target_lps is not None else None
        palt: AltTokens | None = None
        if alts is not None:
            palt = (alts[0][start : start + n - 1], alts[1][start : start + n - 1].to(acc))
        out[g] = PromptForward(output_logits(last_hidden[g : g + 1], weight)[0], plp, ptop, caches[g], tlp, palt)
    return out
