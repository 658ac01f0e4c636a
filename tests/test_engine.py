"""Engine layout invariance (float64): one request at (DP, CP) in {(1,1), (1,2), (2,1), (2,2), (1,4)} and two
per-rank budgets gives the same loss, per-datum outputs, gradients and post-step weights within 1e-10, for
every loss; the gradient invariant catches averaging and microbatch scaling; bad requests change nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.tiny_models import hf_model

from ringtune.engine.gradients import GradientInvariantError
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf

LAYOUTS = ((1, 1), (1, 2), (2, 1), (2, 2), (1, 4))
BUDGETS = (48, 256)  # per-rank tokens: 48 splits the request into several microbatches at CP 1
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
DATUM_LENS = (2, 17, 5, 40, 3, 9, 2, 13)  # 2-17-token rows and one longer than a chunk at every CP
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0)


def make_data(lens: tuple[int, ...], loss_fn: str, vocab: int, seed: int = 0) -> list[TrainDatum]:
    gen = torch.Generator().manual_seed(seed)
    data = []
    for n in lens:
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.randn(n, generator=gen, dtype=torch.float64)  # any real, negatives too
        else:
            inputs["logprobs"] = -torch.rand(n, generator=gen, dtype=torch.float64) * 5
            inputs["advantages"] = torch.randn(n, generator=gen, dtype=torch.float64)
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = (torch.rand(n, generator=gen) < 0.8).double()
        data.append(TrainDatum(tokens=tokens, inputs=inputs))
    return data


def _trainer(ctx, dp: int, cp: int, budget: int, root: str, **kwargs) -> Trainer:
    mesh = ctx.mesh(dp=dp, cp=cp)
    model = load_hf(root, dtype=torch.float64)
    return Trainer(model, mesh, max_tokens_per_rank=budget, **kwargs)


def invariance_case(ctx, *, loss_fn: str, root: str, lens=DATUM_LENS):
    """Every layout and budget on every rank; the result rank of each replica reports its numbers."""
    results = {}
    for dp, cp in LAYOUTS:
        for budget in BUDGETS:
            trainer = _trainer(ctx, dp, cp, budget, root, gated_delta="chunkwise" if cp == 4 else "headwise")
            data = make_data(lens, loss_fn, trainer.model.config.vocab_size)
            result = trainer.forward_backward(data, loss_fn)
            grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=trainer.dp_cp_group)  # the global gradient, as optim_step sees it
            metrics = trainer.optim_step(ADAM)
            if trainer.is_result_rank:
                weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                results[dp, cp, budget] = {
                    "loss": result.metrics["loss:sum"],
                    "outputs": result.outputs,
                    "grads": grads,
                    "weights": weights,
                    "grad_norm": metrics["grad_norm:mean"],
                }
    return results


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "qwen3_5"
    hf_model("qwen3_5", seed=21).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_layout_invariance_float64(pool4, checkpoint, loss_fn):
    per_rank = pool4.run(invariance_case, loss_fn=loss_fn, root=checkpoint)
    runs = {key: value for res in per_rank for key, value in res.items()}  # identical replicas agree
    ref = runs[1, 1, BUDGETS[-1]]
    assert set(runs) == {(dp, cp, b) for dp, cp in LAYOUTS for b in BUDGETS}
    for key, run in runs.items():
        assert abs(run["loss"] - ref["loss"]) <= 1e-10 * max(1.0, abs(ref["loss"])), key
        for got, want in zip(run["outputs"], ref["outputs"], strict=True):
            assert max_diff(got, want) <= 1e-10, key
        assert max_diff(run["grads"], ref["grads"]) <= 1e-10, key
        assert max_diff(run["weights"], ref["weights"]) <= 1e-10, key
    assert ref["grad_norm"] > 0


def lone_datum_case(ctx, *, root: str):
    """One datum at DP=2: the second DP rank runs a pad-only microbatch."""
    out = {}
    for dp, cp in ((1, 1), (2, 2), (2, 1)):
        trainer = _trainer(ctx, dp, cp, 256, root)
        data = make_data((11,), "cross_entropy", trainer.model.config.vocab_size, seed=3)
        result = trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(ADAM)
        if trainer.is_result_rank:
            out[dp, cp] = (result.outputs, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    return out


def test_lone_datum_pad_only_microbatches(pool4, checkpoint):
    runs = {k: v for res in pool4.run(lone_datum_case, root=checkpoint) for k, v in res.items()}
    ref_outputs, ref_weights = runs[1, 1]
    for key, (outputs, weights) in runs.items():
        assert max_diff(outputs[0], ref_outputs[0]) <= 1e-10, key
        assert max_diff(weights, ref_weights) <= 1e-10, key


def fault_case(ctx, *, root: str, fault: str):
    try:
        _trainer(ctx, 2, 2, 48, root, fault=fault)
    except GradientInvariantError as err:
        return str(err)
    return None


@pytest.mark.parametrize("fault", ["average_over_group", "scale_by_microbatches"])
def test_negative_control_invariant_catches_scaled_reduction(pool4, checkpoint, fault):
    for message in pool4.run(fault_case, root=checkpoint, fault=fault):
        assert message is not None and "gradient invariant violated" in message


def test_bad_requests_change_nothing(checkpoint):
    trainer = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=48)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    vocab = trainer.model.config.vocab_size
    good = make_data((5,), "cross_entropy", vocab)
    with pytest.raises(UserInputError, match=r"data\[1\]: 60 tokens need 64 tokens per rank"):
        trainer.forward_backward([*good, *make_data((60,), "cross_entropy", vocab)], "cross_entropy")
    with pytest.raises(UserInputError, match=r"adam_params\.beta2"):
        trainer.optim_step(AdamParams(beta2=1.5))
    with pytest.raises(UserInputError):
        trainer.forward_backward(good, "stable_reinforce")
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.optim_step(AdamParams(learning_rate=0.0))
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_save_load_state_resumes_bit_identically(checkpoint, tmp_path):
    def run(trainer, steps):
        losses = []
        for step in steps:
            data = make_data(DATUM_LENS, "importance_sampling", trainer.model.config.vocab_size, seed=step)
            losses.append(trainer.forward_backward(data, "importance_sampling").metrics["loss:sum"])
            trainer.optim_step(AdamParams(learning_rate=1e-2 * (step + 1), grad_clip_norm=1.0))
        return losses

    straight = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=256)
    want = run(straight, range(4))
    first = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=256)
    run(first, range(2))
    first.save_state(str(tmp_path / "state"))
    resumed = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=256)
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.step == 2
    assert run(resumed, range(2, 4)) == want[2:]
    resumed.export_hf(str(tmp_path / "hf"))
    assert torch.equal(load_hf(tmp_path / "hf").model.norm.weight, resumed.model.model.norm.weight)
