"""Replicas checked to stay identical after every optim_step (:mod:`ringtune.engine.replica_check`).

Without ranks: the bitwise checksum sees a one-element change in every dtype (+0 / -0 too) and the mismatch
message names the tensors and ranks. On four real gloo ranks (the tiny Qwen3.5 at DP2×CP2): replicas stay
bit-identical over two steps with weight decay and clipping in float32, bfloat16 and bf16-mixed, replicated and
sharded over DP (the CP ranks of a DP coordinate compared) and over DP×CP (only the unsharded state compared);
``weight_decay_skipped_cp1`` makes the first step raise ReplicaDivergedError on every rank naming tensors and
ranks, and every later request of that trainer fails; ``sharded_step_count_cp1`` does the same under dp_cp.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.tiny_models import hf_model
from test_engine import ADAM, make_data

from ringtune.engine.replica_check import ReplicaCheck, ReplicaDivergedError, checksums
from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf

LENS = (2, 17, 5, 40, 3, 9, 2, 13)
BUDGET = 48
CLIPPED = replace(ADAM, weight_decay=0.1, grad_clip_norm=0.05)  # weight decay on, clipping active
STEPS = (ADAM, CLIPPED)


def test_checksum_sees_one_element_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        x = torch.randn(1000, dtype=torch.float64).to(dtype)
        base = checksums([x])
        for i in (0, 517, 999):
            y = x.clone()
            y[i] = torch.nextafter(y[i].float(), torch.tensor(float("inf"))).to(dtype)  # 1 ulp (or more in bf16)
            if y[i] == x[i]:
                y[i] = x[i] * 2
            assert checksums([y]) != base, (dtype, i)
        z = torch.zeros(4, dtype=dtype)
        signed = z.clone()
        signed[1] = -0.0
        assert checksums([z]) != checksums([signed])  # -0.0 differs from +0.0 bitwise
    assert checksums([torch.tensor(3.0)]) == checksums([torch.tensor([3.0])])  # 0-d tensors (AdamW step)


def test_mismatch_names_tensors_and_ranks():
    names = ["a.weight", "a.weight.exp_avg", "a.weight.exp_avg_sq"]
    every = [(), (), ()]
    same = [(1, every, [1, 2, 3])] * 3
    assert ReplicaCheck._mismatches(same, names) == ("", 3)
    drift = [(1, every, [1, 2, 3]), (1, every, [1, 2, 3]), (1, every, [1, 9, 3]), (1, every, [1, 2, 3])]
    message, compared = ReplicaCheck._mismatches(drift, names)
    assert "control ranks 0 and 2" in message and "a.weight.exp_avg" in message and "exp_avg_sq" not in message
    assert compared == 3
    # Keyed per tensor: "w" is sharded over two DP coordinates (the ranks of one key hold one shard), "w.step"
    # is held whole by every rank.
    keys = [[(("dp", 0),), ()], [(("dp", 0),), ()], [(("dp", 1),), ()], [(("dp", 1),), ()]]
    sharded = [(1, keys[r], [1 if r < 2 else 5, 7]) for r in range(4)]
    assert ReplicaCheck._mismatches(sharded, ["w", "w.step"]) == ("", 2)
    # dp_cp: no two ranks share a shard of "w" (nothing compared), but the step count still is.
    alone = [(1, [(("dp_cp", r),), ()], [r, 7 if r != 1 else 8]) for r in range(4)]
    message, compared = ReplicaCheck._mismatches(alone, ["w", "w.step"])
    assert compared == 1 and "1 tensor(s) differ between control ranks 0 and 1: w.step" in message
    assert ReplicaCheck._mismatches(alone[:1], ["w", "w.step"]) == ("", 0)


def replica_case(ctx, *, root: str, dtype: str, shard: str, fault: str | None):
    """Two optim steps at DP2×CP2; returns (metrics of each step, error text of a step, later error text)."""
    mixed = dtype == "bf16-mixed"
    weights_dtype = torch.float32 if mixed else getattr(torch, dtype)
    options = {"compute_dtype": torch.bfloat16} if mixed else {}
    trainer = Trainer(
        load_hf(root, dtype=weights_dtype),
        ctx.mesh(dp=2, cp=2),
        max_tokens_per_rank=BUDGET,
        shard_params=shard,
        debug_fault=fault,
        **options,
    )
    data = make_data(LENS, "cross_entropy", trainer.model.config.vocab_size, seed=3)
    metrics, error, later = [], None, None
    for adam in STEPS:
        trainer.forward_backward(data, "cross_entropy")
        try:
            metrics.append(trainer.optim_step(adam))
        except ReplicaDivergedError as exc:
            assert not isinstance(exc, UserInputError)
            error = str(exc)
            break
    if error is not None:
        try:
            trainer.forward(data, "cross_entropy")
        except ReplicaDivergedError as exc:
            later = str(exc)
    return metrics, error, later


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("replica_check") / "qwen3_5"
    hf_model("qwen3_5", seed=5).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    ("dtype", "shard"),
    [("float32", "none"), ("bfloat16", "none"), ("bf16-mixed", "none"), ("float32", "dp"), ("bf16-mixed", "dp_cp")],
)
def test_honest_replicas_stay_bit_identical(pool4, checkpoint, dtype, shard):
    for metrics, error, _ in pool4.run(replica_case, root=checkpoint, dtype=dtype, shard=shard, fault=None):
        assert error is None, error
        assert len(metrics) == 2
        # parameters and both moments compared; under dp_cp (no shared shards) the step counts and rotary tables
        assert all(m["replica_tensors:max"] > 0 for m in metrics)
        assert metrics[1]["grad_norm:mean"] > CLIPPED.grad_clip_norm  # clipping acted on step 2


def test_weight_decay_skipped_on_one_cp_rank_is_a_server_error(pool4, checkpoint):
    results = pool4.run(replica_case, root=checkpoint, dtype="float32", shard="none", fault="weight_decay_skipped_cp1")
    for metrics, error, later in results:
        # ADAM has weight decay 0.01: the replicas of CP rank 1 (control ranks 1 and 3) drift at step 1.
        assert metrics == [] and error is not None
        assert (
            "replicas diverged after optim_step 1" in error and "control ranks 0 and 1" in error and "0 and 3" in error
        )
        assert ".weight" in error and "untrusted" in error
        assert later is not None and "untrusted since an earlier optim_step" in later


def test_step_count_drift_under_dp_cp_is_a_server_error(pool4, checkpoint):
    """dp_cp: every rank holds its own shard of every parameter and moment, yet the AdamW step counts are whole on
    every rank; ``sharded_step_count_cp1`` (CP rank 1 counts each step twice) is seen at the first step that has
    AdamW state to count (step 2)."""
    results = pool4.run(replica_case, root=checkpoint, dtype="float32", shard="dp_cp", fault="sharded_step_count_cp1")
    for metrics, error, later in results:
        assert len(metrics) == 1 and error is not None
        assert "replicas diverged after optim_step 2" in error and ".step" in error and "control ranks 0 and 1" in error
        assert later is not None
