"""Qwen3.5 with images (vision tower + MRoPE) under CP: equal to transformers and to CP = 1.

Rows mix text-only sequences and sequences with 1-3 images of different sizes (:data:`support.tiny_vl.SEQUENCES`).
Each case runs on 4 gloo ranks (DP × CP): float32 log-probs and parameter gradients (language and vision, summed
over the CP group) against transformers' ``Qwen3_5ForConditionalGeneration`` run one sequence at a time; float64
CP 2/4 against this model at CP 1 within 1e-10; and the negative control: MRoPE positions numbered on the shard
instead of the whole sequence are refused at run time.
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import next_token_labels
from support.tiny_vl import hf_vl_logprobs, hf_vl_model, vl_sequences

from ringtune.errors import ParallelConfigError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import hf_saved_name, load_hf
from ringtune.models.shard import PackedShard, shard_of

# float32 tolerances: the two models add the same float32 terms in different orders (fused vs per-sequence
# kernels, index_copy vs masked_scatter), ~1e-7 relative per op through 4 decoder + 2 vision layers.
F32_LOGPROB_ATOL = 2e-5
F32_GRAD_RTOL = 2e-4


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _ours(model, ids, labels, weights, shard):
    lp = model.label_logprobs(zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)
    (lp * zigzag_slice(weights, shard.plan)).sum().backward()
    return lp.detach(), _grads(model)


def _to_row(lp: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, log-probs) of the real local tokens."""
    return plan.row_index[plan.is_real], lp[plan.is_real]


def _grad_errors(grads, ref) -> dict[str, float]:
    """Max |g - ref| / max(|ref|, 1e-3) per group ("vision" / "language"), absolute |g - ref| for float64."""
    errors = {"vision": 0.0, "language": 0.0}
    for n, g in grads.items():
        r = ref[n]
        group = "vision" if ".visual." in f".{n}" else "language"
        scale = 1.0 if g.dtype == torch.float64 else max(float(r.abs().max()), 1e-3)
        errors[group] = max(errors[group], float((g - r).abs().max()) / scale)
    return errors


def _row(sequences):
    """(lens, images per sequence, ids, labels, weights) of the packed row of ``sequences``."""
    lens = [len(ids) for ids, _ in sequences]
    ids = torch.cat([s for s, _ in sequences])
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return lens, [imgs for _, imgs in sequences], ids, next_token_labels(ids, tuple(lens)), weights


def references(path) -> dict:
    """What every rank compares with: transformers' float32 row log-probs and gradients (keyed by our names) and
    this model's float64 row log-probs and gradients at CP 1."""
    import transformers

    lens, images, ids, labels, weights = _row(vl_sequences(seed=3))
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    hf_lp = hf_vl_logprobs(hf, vl_sequences(seed=3), labels)
    (hf_lp.double() * weights).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    model = load_hf(path, dtype=torch.float64)
    shard = shard_of(lens, images=images, spatial_merge_size=2)
    lp, grads = _ours(model, ids, labels, weights, shard)
    rows, local = _to_row(lp, shard.plan)
    return {
        "f32_logprob": hf_lp.detach(),
        "f32_grads": {n: hf_grads[hf_saved_name(n, vision_language=True)] for n in grads},
        "f64_logprob": torch.zeros(len(ids), dtype=torch.float64).index_copy(0, rows, local),
        "f64_grads": grads,
    }


def vl_case(ctx, *, cp: int, root: str, gated_delta: str, ref: dict):
    import pathlib

    import torch.distributed as dist

    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    path = pathlib.Path(root) / "qwen3_5"
    lens, images, ids, labels, weights = _row(vl_sequences(seed=3))
    sharded = {
        "cp_size": cp, "cp_rank": mesh.cp_rank, "group": mesh.cp_group, "attention": "ring",
        "gated_delta": gated_delta, "pad_multiplier": 4, "images": images, "spatial_merge_size": 2,
    }  # fmt: skip
    shard = shard_of(lens, **sharded)
    out = {}
    for dtype, key in ((torch.float32, "f32"), (torch.float64, "f64")):
        lp, grads = _ours(load_hf(path, dtype=dtype), ids, labels, weights, shard)
        for g in grads.values():
            dist.all_reduce(g, group=mesh.cp_group)  # replicated parameters: gradients SUM over CP
        rows, local = _to_row(lp, shard.plan)
        out[f"{key}_logprob"] = float((local - ref[f"{key}_logprob"][rows].to(dtype)).abs().max())
        out.update({f"{key}_grad_{k}": v for k, v in _grad_errors(grads, ref[f"{key}_grads"]).items()})
        out[f"{key}_vision_grad_norm"] = float(sum(g.norm() for n, g in grads.items() if "visual" in n))

    # negative control: each sequence's local part numbered as one sequence (0, 1, ... over its two chunks)
    plan = shard.plan
    on_shard = plan.positions.clone()
    for start, c in zip(plan.local_starts, plan.chunk_lens, strict=True):
        on_shard[start : start + 2 * c] = torch.arange(2 * c)
    on_shard = torch.where(plan.is_real, on_shard, plan.positions)  # only real tokens misnumbered
    try:
        PackedShard(
            plan=plan, positions=plan.positions, group=mesh.cp_group, images=shard.images,
            mrope_positions=on_shard.expand(3, -1).clone(),
        )  # fmt: skip
        out["refused"] = ""
    except ParallelConfigError as error:
        out["refused"] = str(error)
    return out


@pytest.fixture(scope="module")
def vl_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    hf_vl_model("qwen3_5", seed=5).save_pretrained(root / "qwen3_5")
    return root, references(root / "qwen3_5")


@pytest.mark.parametrize(("cp", "gated_delta"), [(2, "chunkwise"), (4, "headwise")])
def test_vl_cp_equals_transformers_and_cp1(pool4, vl_root, cp, gated_delta):
    root, ref = vl_root
    per_rank = pool4.run(vl_case, cp=cp, root=str(root), gated_delta=gated_delta, ref=ref)
    for rank, out in enumerate(per_rank):
        assert out["f32_logprob"] < F32_LOGPROB_ATOL, (rank, out)
        assert out["f32_grad_language"] < F32_GRAD_RTOL and out["f32_grad_vision"] < F32_GRAD_RTOL, (rank, out)
        assert out["f64_logprob"] < 1e-10, (rank, out)
        assert out["f64_grad_language"] < 1e-10 and out["f64_grad_vision"] < 1e-10, (rank, out)
        assert out["f64_vision_grad_norm"] > 0, (rank, out)  # the tower is trained, not bypassed
        assert "numbered on the shard" in out["refused"] and "row token -1" not in out["refused"], (rank, out)
