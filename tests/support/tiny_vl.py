"""Tiny random Qwen3.5 vision-language models (dense and MoE) and packed rows mixing text and images.

The text decoder is :func:`support.tiny_models.hf_config`'s (vocab 96, hidden 32, rotary dim 4); the tower has
2 blocks of width 16, 4-pixel patches, merge size 2 and a 4×4 learned position grid (resampled to every image's
grid). Image pad token 90; random text tokens are drawn below 88 so they never collide with it.
"""

from __future__ import annotations

import torch

from ringtune.models.image_input import ImageInput
from support.tiny_models import hf_config

IMAGE_TOKEN = 90
MERGE = 2
PATCH_DIM = 3 * 2 * 4 * 4
VISION = {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "spatial_merge_size": MERGE,
    "temporal_patch_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
}

# Sequences of a packed row: (length, [(token_start, grid_thw), ...]): text only, 1, 2 and 3 images of
# different sizes, an image at the very start and one ending the sequence.
SEQUENCES = (
    (9, []),
    (30, [(4, (1, 4, 6))]),
    (23, [(0, (1, 2, 2)), (5, (1, 6, 4))]),
    (41, [(2, (1, 4, 4)), (10, (1, 2, 8)), (33, (1, 4, 8))]),
    (13, [(12, (1, 2, 2))]),
)


def hf_vl_model(family: str = "qwen3_5", *, seed: int):
    """A random ``Qwen3_5ForConditionalGeneration`` (family "qwen3_5") or ``Qwen3_5MoeForConditionalGeneration``
    ("qwen3_5_moe"), eager attention, norms and MoE routers randomised as in :func:`support.tiny_models.hf_model`."""
    import transformers

    torch.manual_seed(seed)
    text = hf_config(family).to_dict()
    cls, config_cls = {
        "qwen3_5": (transformers.Qwen3_5ForConditionalGeneration, transformers.Qwen3_5Config),
        "qwen3_5_moe": (transformers.Qwen3_5MoeForConditionalGeneration, transformers.Qwen3_5MoeConfig),
    }[family]
    config = config_cls(
        text_config=text,
        vision_config=VISION,
        image_token_id=IMAGE_TOKEN,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-3.0, 1.0, p.numel()))
            if "visual" in name and name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def vl_sequences(sequences=SEQUENCES, *, seed: int) -> list[tuple[torch.Tensor, list[ImageInput]]]:
    """Per sequence: int64 token ids (image tokens = IMAGE_TOKEN at each image's span) and its images (float32
    random pixels, ``token_start`` relative to the sequence)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, spans in sequences:
        ids = torch.randint(0, 88, (n,), generator=gen)
        images = []
        for start, grid in spans:
            count = grid[0] * grid[1] * grid[2] // MERGE**2
            ids[start : start + count] = IMAGE_TOKEN
            pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen)
            images.append(ImageInput(pixel_values=pixels, grid_thw=grid, token_start=start, num_tokens=count))
        out.append((ids, images))
    return out


def hf_vl_logprobs(model, sequences, labels: torch.Tensor) -> torch.Tensor:
    """[T] log-probs of ``labels`` (packed row order; IGNORE_INDEX entries give 0) by a transformers VL ``model``
    run one sequence at a time with its images (``mm_token_type_ids`` marking the image tokens); differentiable."""
    out, start = [], 0
    for ids, images in sequences:
        kwargs = {}
        if images:
            kwargs = {
                "pixel_values": torch.cat([im.pixel_values for im in images]).to(model.dtype),
                "image_grid_thw": torch.tensor([im.grid_thw for im in images]),
                "mm_token_type_ids": (ids == IMAGE_TOKEN).int()[None],
            }
        logp = (
            model(input_ids=ids[None], **kwargs)
            .logits[0]
            .to(torch.float64 if model.dtype == torch.float64 else torch.float32)
            .log_softmax(-1)
        )
        lab = labels[start : start + len(ids)]
        out.append(torch.where(lab >= 0, logp.gather(-1, lab.clamp(min=0)[:, None])[:, 0], 0.0))
        start += len(ids)
    return torch.cat(out)
