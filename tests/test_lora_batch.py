"""Several LoRA runs in one pass (ringtune.engine.lora_batch, ringtune.models.lora_mixed) on 4 gloo ranks.

float64, tiny Qwen3.5 hybrid (GatedDeltaNet split q/k/v adapters and full attention), three runs of different
ranks and target sets on one base: at (DP, CP) in {(1,1), (1,2) headwise, (2,2) full recompute, (1,4)
chunkwise selective}, the joined pass gives every run the outputs, loss, adapter gradients and post-step
adapters of that run alone at (1,1), within 1e-10; one run's datums include a 1-token row, so at CP 4 some
ranks hold none of its tokens. A request invalid on its own gets its own error and the others run.
"""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from support.lora import randomize_adapters
from support.tiny_models import hf_model

from ringtune.engine.lora_batch import forward_backward_many
from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.lora import LoraModel, LoraSpec

LAYOUTS = (
    (1, 1, "none", "headwise"),
    (1, 2, "none", "headwise"),
    (2, 2, "full", "headwise"),
    (1, 4, "selective", "chunkwise"),
)
SPECS = (
    LoraSpec(rank=4, seed=1),
    LoraSpec(rank=2, seed=2, train_mlp=False, train_unembed=False),
    LoraSpec(rank=8, seed=3, train_attn=False),
)
LENS = ((5, 17, 3), (1,), (40, 9, 2))
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def make_data(vocab: int, lens: tuple[int, ...], seed: int) -> list[TrainDatum]:
    gen = torch.Generator().manual_seed(seed)
    data = []
    for n in lens:
        inputs = {
            "target_tokens": torch.randint(0, vocab, (n,), generator=gen),
            "logprobs": -torch.rand(n, generator=gen, dtype=torch.float64) * 5,
            "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
        }
        data.append(TrainDatum(tokens=torch.randint(0, vocab, (n,), generator=gen), inputs=inputs))
    return data


def batch_case(ctx, *, root: str):
    base = load_hf(pathlib.Path(root), dtype=torch.float64)
    vocab = base.config.vocab_size
    data = [make_data(vocab, lens, seed=10 + i) for i, lens in enumerate(LENS)]
    results = {}
    for dp, cp, recompute, gated_delta in LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp)
        for joined in (False, True):
            trainers = []
            for i, spec in enumerate(SPECS):
                model = LoraModel(base, spec)
                randomize_adapters(model, seed=20 + i)
                trainers.append(
                    LoraTrainer(model, mesh, max_tokens_per_rank=48, gated_delta=gated_delta, recompute=recompute)
                )
            if joined:
                outcomes = forward_backward_many(trainers, data, "importance_sampling")
            else:
                outcomes = [t.forward_backward(d, "importance_sampling") for t, d in zip(trainers, data, strict=True)]
            per_run = []
            for trainer, outcome in zip(trainers, outcomes, strict=True):
                assert not isinstance(outcome, Exception), outcome
                grads = {
                    n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()  # a rank with no token
                    for n, p in trainer.model.named_parameters()
                }
                for g in grads.values():
                    dist.all_reduce(g, group=trainer.dp_cp_group)
                trainer.optim_step(ADAM)
                weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                per_run.append((outcome.metrics, outcome.outputs, grads, weights))
            if trainers[0].is_result_rank:
                results[dp, cp, joined] = per_run
    # one run's request is invalid: it gets its error, the other two run (and equal their joined results above)
    mesh = ctx.mesh(dp=1, cp=2)
    trainers = [LoraTrainer(LoraModel(base, spec), mesh, max_tokens_per_rank=48) for spec in SPECS]
    bad = [replace(make_data(vocab, (3,), seed=99)[0], tokens=torch.tensor([1, vocab + 5, 2]))]
    outcomes = forward_backward_many(trainers, [data[0], bad, data[2]], "importance_sampling")
    if trainers[0].is_result_rank:
        results["bad"] = [o if isinstance(o, Exception) else o.metrics for o in outcomes]
    return results


def _max(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_batch") / "qwen3_5"
    hf_model("qwen3_5", seed=21).save_pretrained(path)
    return str(path)


def test_joined_pass_equals_each_run_alone_float64(pool4, root):
    results = {k: v for part in pool4.run(batch_case, root=root) for k, v in part.items()}
    ref = results[1, 1, False]
    for (dp, cp, joined), per_run in ((k, v) for k, v in results.items() if k != "bad"):
        for r, ((metrics, outputs, grads, weights), (m0, o0, g0, w0)) in enumerate(zip(per_run, ref, strict=True)):
            where = (dp, cp, joined, r)
            assert abs(metrics["loss:sum"] - m0["loss:sum"]) <= 1e-10 * max(1.0, abs(m0["loss:sum"])), where
            assert metrics["num_tokens:sum"] == m0["num_tokens:sum"], where
            assert metrics.get("lora_pass_runs:max", 1.0) == (3.0 if joined else 1.0), where
            for got, want in zip(outputs, o0, strict=True):
                assert _max(got, want) <= 1e-10, where
            assert _max(grads, g0) <= 1e-10, where
            assert max(float(g.abs().max()) for g in g0.values()) > 0, where
            assert _max(weights, w0) <= 1e-10, where
    first, bad, third = results["bad"]
    assert isinstance(bad, UserInputError) and "vocab" in str(bad)
    assert first["lora_pass_runs:max"] == third["lora_pass_runs:max"] == 2.0
