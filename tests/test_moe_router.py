"""MoE router statistics through the Trainer: the load-balancing aux loss against transformers' and CP-invariant
in float64 (CP1 vs CP2 gradients), and the per-layer expert load metrics equal at CP1 and CP2."""

from __future__ import annotations

import pathlib

import pytest
import torch
from support.tiny_models import hf_model

from ringtune.models.checkpoints.hf import load_hf

pytest.importorskip("transformers")
COEF = 0.5


def _data(vocab: int):
    from ringtune.engine.batch import TrainDatum

    gen = torch.Generator().manual_seed(5)
    out = []
    for n in (7, 30, 3, 21):
        inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
        inputs["weights"] = torch.randn(n, generator=gen, dtype=torch.float64)
        out.append(TrainDatum(tokens=torch.randint(0, vocab, (n,), generator=gen), inputs=inputs))
    return out


def router_case(ctx, *, root: str) -> dict[str, float]:
    """Trainer CP1 (coef 0 and COEF) and CP2 (COEF) on one packed row: gradients (CP2 summed over CP) and metrics."""
    import torch.distributed as dist
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from ringtune.engine.trainer import Trainer
    from ringtune.models.layers.moe import moe_blocks
    from ringtune.models.layers.moe_router_stats import router_aux_loss

    path = pathlib.Path(root)
    data = _data(96)

    def run(coef: float, mesh):
        trainer = Trainer(load_hf(path, dtype=torch.float64), mesh, max_tokens_per_rank=128, router_aux_loss_coef=coef)
        metrics = trainer.forward_backward(data, "cross_entropy").metrics
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        return trainer, metrics, grads

    _, plain_metrics, plain_grads = run(0.0, None)
    one, one_metrics, one_grads = run(COEF, None)
    # The aux term of the (only) row against transformers' on the captured router inputs of its real tokens.
    inputs = []
    hooks = [b.register_forward_hook(lambda m, a, o: inputs.append(a[0].detach()[a[2]])) for b in moe_blocks(one.model)]
    one.forward(data, "cross_entropy")
    for h in hooks:
        h.remove()
    block = moe_blocks(one.model)[0]
    logits = tuple(x @ b.gate.weight.detach().t() for x, b in zip(inputs, moe_blocks(one.model), strict=True))
    want = float(load_balancing_loss_func(logits, block.experts.num_experts, block.gate.top_k))
    got = float(router_aux_loss(moe_blocks(one.model), None))
    mesh = ctx.mesh(dp=1, cp=2)
    _, cp2_metrics, cp2_grads = run(COEF, mesh)
    for g in cp2_grads.values():
        dist.all_reduce(g, group=mesh.cp_group)
    out = {
        "aux vs transformers": abs(got - want) / abs(want),
        "grad CP2 vs CP1": max(float((cp2_grads[n] - g).abs().max()) for n, g in one_grads.items()),
        "aux changes the router gradient": -max(
            float((one_grads[n] - plain_grads[n]).abs().max()) for n in one_grads if n.endswith("gate.weight")
        ),
    }
    loads = sorted(k for k in one_metrics if k.startswith("moe/"))
    out["load metrics"] = float(len(loads))
    if ctx.rank == 0:
        out["load CP2 vs CP1"] = max(abs(cp2_metrics[k] - one_metrics[k]) for k in loads)
        out["load coef vs none"] = max(abs(plain_metrics[k] - one_metrics[k]) for k in loads)
        out["load min"] = min(one_metrics[k] for k in loads)
    return out


def test_router_aux_loss_and_load_metrics(pool4, tmp_path):
    hf_model("qwen3_5_moe", seed=11).save_pretrained(tmp_path)
    per_rank = pool4.run(router_case, root=str(tmp_path))
    for key, value in per_rank[0].items():
        print(f"\nrouter: {key}: {value:.3g}")
    first = per_rank[0]
    assert first["aux vs transformers"] < 1e-6  # transformers reduces in float32 (histc, probability sums)
    assert max(r["grad CP2 vs CP1"] for r in per_rank) < 1e-12  # float64: summation order only
    assert first["aux changes the router gradient"] < -1e-6  # the term is really there
    assert first["load metrics"] == 4  # one per MoE layer of the tiny model
    assert first["load CP2 vs CP1"] < 1e-12 and first["load coef vs none"] < 1e-12
    assert first["load min"] >= 1.0
