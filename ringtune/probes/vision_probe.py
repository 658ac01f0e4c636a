"""Layer probe of the vision tower: Qwen3.5's tower under CP, with the product's image placement, against no CP.

Every rank builds the same tiny tower (:data:`PROBE_TOWER`, the probe's seed) and the same packed row
(:func:`vision_row`): sequences holding 1-3 images of different grids (and one text-only sequence), the first
image of each sequence placed across a zigzag chunk boundary that separates two ranks. The CP run is the
product's path: :func:`~ringtune.models.shard.shard_of` with the row's images (placement:
:func:`~ringtune.models.vision.placement.shard_images`, each rank encodes, whole, every image it holds a token
of) and :meth:`CausalLM.input_embeddings <ringtune.models.decoder.CausalLM.input_embeddings>`, the call that
puts the tower's output on the rank's image tokens. The loss is a fixed random projection of the image-token
embeddings each rank keeps (text tokens embed to zero). Compared with the one-process run of the whole row:
the embeddings gathered to row order, the gradient at the patch embedding (the tower's first activation, per
patch; a rank's partial for every image it encodes, summed over CP) and every tower parameter gradient summed
over CP. Pixel values carry no gradient in the product (a float32 input, ``ShardImages.pixel_values``), so the
patch-embedding gradient stands in for it (the pixel gradient is that times the fixed Conv3d weight).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ringtune.layout.zigzag import chunk_len, zigzag_plan, zigzag_slice
from ringtune.models.decoder import CausalLM
from ringtune.models.image_input import ImageInput
from ringtune.models.shard import PackedShard, shard_of
from ringtune.models.vision.config import VisionConfig
from ringtune.models.vision.tower import VisionTower
from ringtune.parallel.collectives import all_reduce_
from ringtune.probes.layer_probe import cosine, low_rows, norm_ratio, row_order

PROBE_TOWER = VisionConfig(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    in_channels=3,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=48,
    num_position_embeddings=16,
    hidden_act="gelu_pytorch_tanh",
    rope_theta=10000.0,
    image_token_id=1,
)
"""Qwen3.5's tower shape at toy size: 3 blocks of 4 heads of 8 (2-D rotary), 2x2 merge, a 4x4 position grid."""

GRIDS = ((1, 4, 4), (1, 4, 6), (1, 6, 4), (1, 8, 6), (1, 6, 10), (1, 2, 4), (1, 10, 6))
"""Image patch grids (t, h, w) drawn per image: 2 to 15 decoder tokens each, square and not."""

VISION_MODES = ("per_image",)
"""The tower's one CP mode: placement's rule (each rank encodes, whole, every image it holds a token of)."""

IMAGES_PER_SEQUENCE = (1, 3, 0, 2, 3, 1)
"""Images of each sequence of the probe row (one text-only sequence)."""


def vision_row(seed: int, cps: tuple[int, ...]) -> tuple[tuple[int, ...], list[list[ImageInput]]]:
    """The probe's packed row: ``(seq_lens, images per sequence)``, seeded, ``token_start`` per sequence.

    Sequence i's first image straddles a chunk boundary ``m·c`` (c = ``chunk_len(n, C)``, C = ``cps[i %
    len(cps)]``, m != C so the two chunks belong to different ranks); later images sit after a random text gap.
    Pixel values: float32 N(0, 1) [t·h·w, patch_dim].
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed + 2)
    merge = PROBE_TOWER.spatial_merge_size
    seq_lens: list[int] = []
    images: list[list[ImageInput]] = []
    for i, count in enumerate(IMAGES_PER_SEQUENCE):
        grids = rng.sample(GRIDS, count)
        sizes = [t * h * w // merge**2 for t, h, w in grids]
        n = sum(sizes) + 4 * count + rng.randint(16, 40)
        cp = cps[i % len(cps)]
        c = chunk_len(n, cp)
        cursor = rng.randint(1, 3)
        seq_images: list[ImageInput] = []
        for j, (grid, k) in enumerate(zip(grids, sizes, strict=True)):
            if j == 0:  # across the first rank-changing boundary with room for half the image before it
                m = next(m for m in range(1, 2 * cp) if m != cp and m * c - k // 2 >= cursor and m * c < n)
                start = m * c - k // 2
            else:
                start = cursor + rng.randint(0, 3)
            if start + k > n - 1:
                break
            pixels = torch.randn(grid[0] * grid[1] * grid[2], PROBE_TOWER.patch_dim, generator=gen, device="cpu")
            seq_images.append(ImageInput(pixel_values=pixels, grid_thw=grid, token_start=start, num_tokens=k))
            cursor = start + k + 1
        seq_lens.append(n)
        images.append(seq_images)
    return tuple(seq_lens), images


def images_on_two_ranks(seq_lens: tuple[int, ...], images: list[list[ImageInput]], cp: int) -> int:
    """How many of the row's images have tokens on more than one rank at CP ``cp`` (encoded on each)."""
    owner = torch.empty(sum(seq_lens), dtype=torch.int64, device="cpu")
    for r in range(cp):
        plan = zigzag_plan(seq_lens, cp_size=cp, cp_rank=r, pad_multiplier=1)
        owner[plan.row_index[plan.is_real]] = r
    shared = 0
    for row_start, seq_images in zip(_row_starts(seq_lens), images, strict=True):
        for im in seq_images:
            shared += owner[row_start + im.token_start : row_start + im.token_end].unique().numel() > 1
    return shared


def _row_starts(seq_lens: tuple[int, ...]) -> list[int]:
    return [sum(seq_lens[:i]) for i in range(len(seq_lens))]


def build_tower(*, dtype: torch.dtype, seed: int) -> VisionTower:
    """:data:`PROBE_TOWER` with PyTorch's default init under ``seed`` (same on every rank), cast to ``dtype``."""
    torch.manual_seed(seed)
    return VisionTower(PROBE_TOWER).to(dtype)


def _encoded(shard: PackedShard, images: list[list[ImageInput]]) -> list[int]:
    """Row-order indices (over all the row's images) of the images ``shard.images`` encodes, in its encoding
    order: read from the placement itself (each kept embedding's row token names its image, its ``embed_index``
    the encoded image it comes from), so the probe measures the product's choice rather than restating it."""
    placed = shard.images
    if placed is None:
        return []
    image_of_row = torch.full((sum(shard.plan.seq_lens),), -1, dtype=torch.int64, device="cpu")
    flat = [
        (r + im.token_start, r + im.token_end)
        for r, seq in zip(shard.plan.row_starts, images, strict=True)
        for im in seq
    ]
    for i, (start, end) in enumerate(flat):
        image_of_row[start:end] = i
    merge = placed.spatial_merge_size**2
    ends = torch.tensor([t * h * w // merge for t, h, w in placed.grids], dtype=torch.int64, device="cpu").cumsum(0)
    block = torch.searchsorted(ends, placed.embed_index, right=True)
    encoded = [-1] * len(placed.grids)
    for b, row in zip(block.tolist(), shard.plan.row_index[placed.local_index].tolist(), strict=True):
        encoded[b] = int(image_of_row[row])
    if -1 in encoded:
        raise RuntimeError(f"an image encoded by this rank keeps no token (grids {placed.grids}): {encoded}")
    return encoded


def _run(tower: VisionTower, shard: PackedShard, w_row: torch.Tensor, images: list[list[ImageInput]]):
    """Forward + backward on ``shard``: (embeddings [local_len, out_hidden], patch grads of the whole row's
    patches [P, hidden] with this rank's partials in place, parameter grads); grads cleared after."""
    patches: list[torch.Tensor] = []

    def keep(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        patches.append(out)

    hook = tower.patch_embed.register_forward_hook(keep)
    dtype = tower.pos_embed.weight.dtype
    embed_tokens = nn.Embedding(2, PROBE_TOWER.out_hidden_size).to(dtype).requires_grad_(False)
    nn.init.zeros_(embed_tokens.weight)
    # Only ``model.embed_tokens`` and ``model.visual`` are read by input_embeddings: a holder of the two stands in.
    model = cast(CausalLM, SimpleNamespace(model=SimpleNamespace(embed_tokens=embed_tokens, visual=tower)))
    ids = torch.full((shard.plan.local_len,), PROBE_TOWER.image_token_id, dtype=torch.int64, device="cpu")
    try:
        x = CausalLM.input_embeddings(model, ids, shard)  # the decoder's own call into the tower
    finally:
        hook.remove()
    loss = (x * zigzag_slice(w_row, shard.plan)).sum()
    if loss.requires_grad:  # else this rank keeps no image token: every gradient is zero
        loss.backward()
    counts = [im.pixel_values.shape[0] for seq in images for im in seq]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    patch_grad = w_row.new_zeros(sum(counts), PROBE_TOWER.hidden_size)
    if patches:  # this rank encoded images: their patches' gradients, in its encoding order
        encoded = _encoded(shard, images)
        local_grad = patches[0].grad
        if local_grad is None or local_grad.shape[0] != sum(counts[i] for i in encoded):
            raise RuntimeError(f"patch gradient of the encoded images {encoded} is missing or misshapen")
        for i, g in zip(encoded, local_grad.split([counts[i] for i in encoded]), strict=True):
            patch_grad[offsets[i] : offsets[i] + counts[i]] = g
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in tower.named_parameters()
    }
    tower.zero_grad(set_to_none=True)
    return x.detach(), patch_grad, grads


def vision_entry(rank: int, cp: int, group: dist.ProcessGroup, *, dtype: torch.dtype, seed: int, cps) -> dict:
    """The ``vision`` entry of the probe's report at CP ``cp`` (every rank of ``group`` calls; rank 0's is full).

    CP: this rank's :func:`_run` on its shard; embeddings all-gathered to row order, patch and parameter
    gradients SUM over ``group``. Reference (rank 0): the whole row in one process, same dtype.
    """
    seq_lens, images = vision_row(seed, tuple(cps))
    tower = build_tower(dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 3)
    w_row = (torch.randn(sum(seq_lens), PROBE_TOWER.out_hidden_size, generator=gen, device="cpu") / 48**0.5).to(dtype)
    merge = PROBE_TOWER.spatial_merge_size
    shard = shard_of(seq_lens, cp_size=cp, cp_rank=rank, group=group, images=images, spatial_merge_size=merge)
    out, patch_grad, grads = _run(tower, shard, w_row, images)
    parts = [torch.empty_like(out) for _ in range(cp)]
    dist.all_gather(parts, out.contiguous(), group=group)
    out = row_order(out, [shard.plan.for_rank(r) for r in range(cp)], parts)
    for g in (patch_grad, *grads.values()):
        all_reduce_(g, group)
    entry = {
        "layer": "vision",
        "mode": VISION_MODES[0],
        "cp": cp,
        "images": (sum(map(len, images)), images_on_two_ranks(seq_lens, images, cp), len(seq_lens)),
    }
    if rank != 0:
        return entry
    ref_shard = shard_of(seq_lens, images=images, spatial_merge_size=merge)
    ref_out, ref_patch, ref_grads = _run(tower, ref_shard, w_row, images)
    ref_out = row_order(ref_out, [ref_shard.plan], [ref_out])
    metrics = {"image embeddings": (cosine(out, ref_out), norm_ratio(out, ref_out))}
    metrics["patch grad"] = (cosine(patch_grad, ref_patch), norm_ratio(patch_grad, ref_patch))
    for name, g in grads.items():
        metrics[name] = (cosine(g, ref_grads[name]), norm_ratio(g, ref_grads[name]))
    entry["metrics"] = metrics
    entry["low_rows"] = {"image embeddings": low_rows(out, ref_out, seq_lens, cp)}
    pairs = [(out, ref_out), (patch_grad, ref_patch), *((g, ref_grads[n]) for n, g in grads.items())]
    entry["max_rel_diff"] = max(_rel_diff(a, b) for a, b in pairs)
    return entry


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (0.0 when both are zero)."""
    scale = float(b.double().abs().max())
    diff = float((a.double() - b.double()).abs().max())
    return 0.0 if diff == 0 else diff / max(scale, 1e-300)
