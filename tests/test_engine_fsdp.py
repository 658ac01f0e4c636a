"""Sharded parameters (``Trainer(shard_params=True)``: FSDP2 over DP, replicated over CP) give the replicated
engine's numbers (float64, within 1e-10): at (DP, CP) in {(2, 1), (2, 2)} against the unsharded (1, 1) run,
over two optim steps (two accumulated ``forward_backward`` calls of several microbatches, then one with
clipping, with plain forwards between), the same losses, per-datum outputs, gradients, grad norms and full
post-step weights; FSDP's default averaging is caught by the start-up probe.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine import ADAM, make_data, max_diff
from torch.distributed.tensor import DTensor

from ringtune.engine.gradients import GradientInvariantError
from ringtune.engine.trainer import Trainer
from ringtune.models.checkpoints.hf import load_hf
from ringtune.testing.tiny_models import hf_model

LAYOUTS = ((1, 1, False), (2, 1, True), (2, 2, True))  # (DP, CP, shard_params); (1, 1) unsharded is the reference
LENS_A = (2, 17, 5, 40, 3, 9, 2, 13)
LENS_B = (7, 11, 4, 30)
BUDGET = 48  # per-rank tokens: several microbatches per call
CLIP = replace(ADAM, grad_clip_norm=0.05)  # below the grad norm of step 2 (asserted), so clipping acts


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the shard's mesh for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in trainer.model.named_parameters()}


def sharded_case(ctx, *, loss_fn: str, root: str):
    """Every layout on every rank; the result rank of each replica reports its numbers."""
    results = {}
    for dp, cp, shard in LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp)
        trainer = Trainer(load_hf(root, dtype=torch.float64), mesh, max_tokens_per_rank=BUDGET, shard_params=shard)
        vocab = trainer.model.config.vocab_size
        data_a, data_b = make_data(LENS_A, loss_fn, vocab, seed=1), make_data(LENS_B, loss_fn, vocab, seed=2)
        runs = [trainer.forward_backward(data_a, loss_fn), trainer.forward_backward(data_b, loss_fn)]
        grads = {n: _full(p.grad) for n, p in trainer.model.named_parameters()}
        if not shard:  # replicated: the global gradient is the SUM optim_step takes
            for g in grads.values():
                torch.distributed.all_reduce(g, group=trainer.dp_cp_group)
        norms = [trainer.optim_step(ADAM)["grad_norm:mean"]]
        weights = [_weights(trainer)]
        runs += [trainer.forward(data_a, loss_fn), trainer.forward_backward(data_b, loss_fn)]
        runs.append(trainer.forward(data_a, loss_fn))  # leaves the root unsharded: optim_step must reshard it
        norms.append(trainer.optim_step(CLIP)["grad_norm:mean"])
        weights.append(_weights(trainer))
        runs.append(trainer.forward(data_a, loss_fn))  # the step-2 weights through forward
        if trainer.is_result_rank:
            results[dp, cp] = {
                "losses": [r.metrics["loss:sum"] for r in runs],
                "outputs": [r.outputs for r in runs],
                "grads": grads,
                "norms": norms,
                "weights": weights,
                "sharded": shard and all(isinstance(p, DTensor) for p in trainer.params),
            }
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_fsdp") / "qwen3_5"
    hf_model("qwen3_5", seed=21).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_sharded_params_match_replicated_float64(pool4, checkpoint, loss_fn):
    runs = {
        key: value for res in pool4.run(sharded_case, loss_fn=loss_fn, root=checkpoint) for key, value in res.items()
    }
    ref = runs[1, 1]
    assert set(runs) == {(dp, cp) for dp, cp, _ in LAYOUTS}
    assert ref["norms"][1] > CLIP.grad_clip_norm
    for key, run in runs.items():
        assert run["sharded"] == (key != (1, 1)), key
        for got, want in zip(run["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= 1e-10 * max(1.0, abs(want)), key
        for got_call, want_call in zip(run["outputs"], ref["outputs"], strict=True):
            for got, want in zip(got_call, want_call, strict=True):
                assert max_diff(got, want) <= 1e-10, key
        assert max_diff(run["grads"], ref["grads"]) <= 1e-10, key
        for got, want in zip(run["norms"], ref["norms"], strict=True):
            assert abs(got - want) <= 1e-10 * max(1.0, want), key
        for got, want in zip(run["weights"], ref["weights"], strict=True):
            assert max_diff(got, want) <= 1e-10, key


def fault_case(ctx, *, root: str, dp: int, cp: int, fault: str):
    try:
        Trainer(
            load_hf(root, dtype=torch.float64),
            ctx.mesh(dp=dp, cp=cp),
            max_tokens_per_rank=BUDGET,
            shard_params=True,
            fault=fault,
        )
    except GradientInvariantError as err:
        return str(err)
    return None


@pytest.mark.parametrize(("dp", "cp"), [(2, 1), (2, 2)])
def test_negative_control_fsdp_default_average_is_caught(pool4, checkpoint, dp, cp):
    for message in pool4.run(fault_case, root=checkpoint, dp=dp, cp=cp, fault="fsdp_default_divide"):
        assert message is not None and "FSDP unit model.layers.0" in message and f"expected {dp * cp:g} x" in message


def test_negative_control_scaled_loss_is_caught_when_sharded(pool4, checkpoint):
    for message in pool4.run(fault_case, root=checkpoint, dp=2, cp=2, fault="scale_by_microbatches"):
        assert message is not None and "the canary summed to" in message
