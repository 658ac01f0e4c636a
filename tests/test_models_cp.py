"""Whole decoders under CP 2 and 4 (ring attention, both GDN modes) equal CP=1, float64, within 1e-10.

Per-token log-probs are gathered back to row order; parameter gradients are summed over the CP group
(the replicated-parameter rule) and compared with the single-process gradients.
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import LENGTHS, hf_model, next_token_labels, packed_tokens

from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.decoder import CausalLM
from ringtune.models.shard import shard_of

ROWS = {"many_datums": LENGTHS, "lone_short": (1,), "mixed": (2, 3, 17, 30)}


def _model(family: str, path) -> CausalLM:
    return load_hf(path, dtype=torch.float64)


def _run(model: CausalLM, ids, labels, weights, shard):
    local = model.label_logprobs(zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)
    (local * zigzag_slice(weights, shard.plan)).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return local.detach(), grads


def decoder_case(ctx, *, family: str, cp: int, gated_delta: str, root: str):
    import pathlib

    import torch.distributed as dist

    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    model = _model(family, pathlib.Path(root) / family)
    errors = {}
    for index, (name, lens) in enumerate(ROWS.items()):
        ids = packed_tokens(lens, model.config.vocab_size, seed=index)
        labels = next_token_labels(ids, lens)
        weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(50 + index), dtype=torch.float64)
        ref_lp, ref_grads = _run(model, ids, labels, weights, shard_of(lens))
        ref_rows = torch.zeros(len(ids), dtype=torch.float64)
        ref_plan = shard_of(lens).plan
        ref_rows[ref_plan.row_index[ref_plan.is_real]] = ref_lp[ref_plan.is_real]
        shard = shard_of(
            lens,
            cp_size=cp,
            cp_rank=mesh.cp_rank,
            group=mesh.cp_group,
            attention="ring",
            gated_delta=gated_delta,
            pad_multiplier=4,
        )
        lp, grads = _run(model, ids, labels, weights, shard)
        real = shard.plan.is_real
        row_err = float((lp[real] - ref_rows[shard.plan.row_index[real]]).abs().max()) if real.any() else 0.0
        grad_err = 0.0
        for n, g in grads.items():
            dist.all_reduce(g, group=mesh.cp_group)
            grad_err = max(grad_err, float((g - ref_grads[n]).abs().max()))
        errors[name] = (row_err, grad_err)
    return errors


@pytest.mark.parametrize(
    ("family", "cp", "gated_delta"),
    [
        ("qwen3_5", 2, "headwise"),
        ("qwen3_5", 2, "chunkwise"),
        ("qwen3_5", 4, "headwise"),
        ("qwen3_5", 4, "chunkwise"),
        ("llama", 2, "headwise"),
        ("llama", 4, "headwise"),
    ],
)
def test_decoder_cp_equals_cp1_float64(pool4, tmp_path_factory, family, cp, gated_delta):
    root = tmp_path_factory.getbasetemp() / "decoders"
    root.mkdir(exist_ok=True)
    if not (root / family).exists():
        hf_model(family, seed=11).save_pretrained(root / family)
    per_rank = pool4.run(decoder_case, family=family, cp=cp, gated_delta=gated_delta, root=str(root))
    for rank, errors in enumerate(per_rank):
        for name, (row_err, grad_err) in errors.items():
            assert row_err < 1e-10 and grad_err < 1e-10, (rank, name, row_err, grad_err)


def staged_decoder_case(ctx, **kwargs):
    """:func:`decoder_case` with CPU tensors host-staged as a gloo group stages CUDA ones (a copy to host memory
    and back around every collective and ring exchange): the path ``benchmarks/gpu_cp2.py`` runs on one GPU."""
    from ringtune.parallel import collectives

    real, staged = collectives.host_staged, []

    def counting(x, group):
        out = real(x, group)
        staged.append(out)
        return out

    collectives.HOST_STAGED_DEVICES.add("cpu")
    collectives.host_staged = counting
    try:
        return decoder_case(ctx, **kwargs), sum(staged)
    finally:
        collectives.HOST_STAGED_DEVICES.discard("cpu")
        collectives.host_staged = real


@pytest.mark.parametrize("gated_delta", ["headwise", "chunkwise"])
def test_host_staged_collectives_equal_cp1_float64(pool4, tmp_path_factory, gated_delta):
    root = tmp_path_factory.getbasetemp() / "decoders"
    root.mkdir(exist_ok=True)
    if not (root / "qwen3_5").exists():
        hf_model("qwen3_5", seed=11).save_pretrained(root / "qwen3_5")
    kwargs = {"family": "qwen3_5", "cp": 2, "gated_delta": gated_delta, "root": str(root)}
    for rank, (errors, staged) in enumerate(pool4.run(staged_decoder_case, **kwargs)):
        assert staged > 0, rank  # the staged path ran
        for name, (row_err, grad_err) in errors.items():
            assert row_err < 1e-10 and grad_err < 1e-10, (rank, name, row_err, grad_err)
