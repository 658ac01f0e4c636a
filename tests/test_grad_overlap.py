"""Replicated gradients reduced during backward (engine/grad_overlap.py): on four gloo ranks (the tiny Qwen3.5 at
DP2×CP2, float32 and float64) the overlapped reduction leaves weights, AdamW moments and the step's figures
bit-identical to the reduction at optim_step, is used only for a step's single request, and is not used when a
gradient changed after it (a second request; a gradient edited on one rank only, which every rank learns):
those steps reduce at optim_step, as before."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import hf_model
from test_engine import ADAM, make_data

from ringtune.engine.trainer import Trainer
from ringtune.models.checkpoints.hf import load_hf

LENS = (2, 17, 5, 40, 3, 9, 2, 13, 21, 6)
BUDGET = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("grad_overlap") / "qwen3_5"
    hf_model("qwen3_5", seed=7).save_pretrained(path)
    return str(path)


def _run(trainer: Trainer, *, overlap: bool, rank: int) -> dict:
    """Three steps: one request; two requests; one request whose gradient is edited before optim_step. Records
    whether each reduction used the overlapped buffers, the figures, and the weights and moments after."""
    used: list[bool] = []
    if not overlap:
        trainer.grad_sync.start_overlap = lambda params: None
    reduce_and_check = trainer.invariant.reduce_and_check

    def recording(grads, expert_grads=(), *, overlapped=None):
        used.append(overlapped is not None)
        return reduce_and_check(grads, expert_grads, overlapped=overlapped)

    trainer.invariant.reduce_and_check = recording
    vocab = trainer.model.config.vocab_size
    figures = []
    launched = []
    for step, requests in enumerate((1, 2, 1)):
        for r in range(requests):
            trainer.forward_backward(make_data(LENS, "cross_entropy", vocab, seed=10 * step + r), "cross_entropy")
        pending = trainer.grad_sync.overlapped
        launched.append(0 if pending is None else pending.launched_in_backward)
        if step == 2 and rank == 2:  # one rank's gradient edited after the request: every rank reduces again
            with torch.no_grad():
                trainer.model.model.norm.weight.grad.mul_(0.5)
        figures.append(trainer.optim_step(ADAM)["grad_norm:mean"])
    state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for p in trainer.params:
        for key, value in trainer.optimizer.state[p].items():
            state[f"{trainer.names[id(p)]}.{key}"] = value.clone()
    return {"used": used, "figures": figures, "state": state, "launched": launched}


def overlap_case(ctx, *, root: str, dtype: str):
    results = []
    for overlap in (True, False):
        trainer = Trainer(load_hf(root, dtype=getattr(torch, dtype)), ctx.mesh(dp=2, cp=2), max_tokens_per_rank=BUDGET)
        results.append(_run(trainer, overlap=overlap, rank=ctx.rank))
    return results


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_overlapped_reduction_is_the_same_sum(pool4, checkpoint, dtype):
    for overlapped, at_step in pool4.run(overlap_case, root=checkpoint, dtype=dtype):
        assert overlapped["used"] == [True, False, False] and at_step["used"] == [False, False, False]
        assert overlapped["launched"][0] > 0  # buckets went out while backward ran
        assert overlapped["figures"] == at_step["figures"]
        state, want = overlapped["state"], at_step["state"]
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], want[k]) for k in want), [
            k for k in want if not torch.equal(state[k], want[k])
        ]
