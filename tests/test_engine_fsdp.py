"""Sharded parameters (``Trainer(shard_params="dp" | "dp_cp")``, FSDP2 over DP or over all DP×CP ranks) give
the replicated engine's numbers (float64, within 1e-10) against the unsharded (1, 1) run, over two optim steps
(two accumulated ``forward_backward`` calls of several microbatches, then one with clipping, with plain forwards
between): the same losses, per-datum outputs, gradients, grad norms and full post-step weights. ``dp`` at
(DP, CP) in {(2, 1), (2, 2)}, ``dp_cp`` at {(1, 2), (2, 2), (1, 4)} (``cross_entropy``; ``ppo`` on one layout of
each). FSDP's default averaging is caught by the start-up probe in both shardings. DCP checkpoints of a
``dp_cp`` trainer reload (weights, AdamW moments, step) into ``dp_cp``, ``dp`` and replicated trainers, and a
replicated one into ``dp_cp``; HF export and sampler snapshots of a sharded trainer hold the whole weights;
bf16-mixed under ``dp_cp`` keeps the layers' bf16/fp32 policy and matches ``dp``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.tiny_models import hf_model
from test_engine import ADAM, make_data, max_diff
from torch.distributed.tensor import DTensor

from ringtune.cli import build_parser
from ringtune.engine.gradients import GradientInvariantError
from ringtune.engine.sharding import check_sharding
from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.sample.pool import snapshot_of
from ringtune.worker.executor import ModelSpec, RankExecutor

# (DP, CP, shard_params) per loss; (1, 1) unsharded is the reference. True is the legacy name of "dp". The
# sharding touches only the gradient path, which every loss shares: the second loss runs one layout of each.
LAYOUTS = {
    "cross_entropy": ((1, 1, "none"), (2, 2, "dp"), (1, 2, "dp_cp"), (2, 2, "dp_cp"), (1, 4, "dp_cp")),
    "ppo": ((1, 1, "none"), (2, 1, True), (2, 2, "dp_cp")),
}
LENS_A = (2, 17, 5, 40, 3, 9, 2, 13)
LENS_B = (7, 11, 4, 30)
BUDGET = 48  # per-rank tokens: several microbatches per call
CLIP = replace(ADAM, grad_clip_norm=0.05)  # below the grad norm of step 2 (asserted), so clipping acts
MESH_DIMS = {"none": None, "dp": ("cp", "dp"), "dp_cp": ("dp_cp",)}


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the shard's mesh for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in trainer.model.named_parameters()}


def sharded_case(ctx, *, loss_fn: str, root: str):
    """Every layout on every rank; the result rank of each replica reports its numbers."""
    results = {}
    for dp, cp, shard in LAYOUTS[loss_fn]:
        mesh = ctx.mesh(dp=dp, cp=cp)
        trainer = Trainer(load_hf(root, dtype=torch.float64), mesh, max_tokens_per_rank=BUDGET, shard_params=shard)
        vocab = trainer.model.config.vocab_size
        data_a, data_b = make_data(LENS_A, loss_fn, vocab, seed=1), make_data(LENS_B, loss_fn, vocab, seed=2)
        runs = [trainer.forward_backward(data_a, loss_fn), trainer.forward_backward(data_b, loss_fn)]
        grads = {n: _full(p.grad) for n, p in trainer.model.named_parameters()}
        if trainer.shard_params == "none":  # replicated: the global gradient is the SUM optim_step takes
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
            results[dp, cp, trainer.shard_params] = {
                "losses": [r.metrics["loss:sum"] for r in runs],
                "outputs": [r.outputs for r in runs],
                "grads": grads,
                "norms": norms,
                "weights": weights,
                "meshes": {p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None for p in trainer.params},
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
    ref = runs[1, 1, "none"]
    assert set(runs) == {(dp, cp, check_sharding(shard)) for dp, cp, shard in LAYOUTS[loss_fn]}
    assert ref["norms"][1] > CLIP.grad_clip_norm
    for key, run in runs.items():
        assert run["meshes"] == {MESH_DIMS[key[2]]}, key  # every parameter a DTensor on the sharding's mesh
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


def fault_case(ctx, *, root: str, dp: int, cp: int, shard: str, fault: str):
    try:
        Trainer(
            load_hf(root, dtype=torch.float64),
            ctx.mesh(dp=dp, cp=cp),
            max_tokens_per_rank=BUDGET,
            shard_params=shard,
            fault=fault,
        )
    except GradientInvariantError as err:
        return str(err)
    return None


@pytest.mark.parametrize(("dp", "cp", "shard"), [(2, 1, "dp"), (2, 2, "dp"), (2, 2, "dp_cp"), (1, 4, "dp_cp")])
def test_negative_control_fsdp_default_average_is_caught(pool4, checkpoint, dp, cp, shard):
    for message in pool4.run(fault_case, root=checkpoint, dp=dp, cp=cp, shard=shard, fault="fsdp_default_divide"):
        assert message is not None and "FSDP unit model.layers.0" in message and f"expected {dp * cp:g} x" in message


@pytest.mark.parametrize("shard", ["dp", "dp_cp"])
def test_negative_control_scaled_loss_is_caught_when_sharded(pool4, checkpoint, shard):
    for message in pool4.run(fault_case, root=checkpoint, dp=2, cp=2, shard=shard, fault="scale_by_microbatches"):
        assert message is not None and "the canary summed to" in message


def test_sharding_names_are_checked(checkpoint):
    assert [check_sharding(v) for v in (False, True, "none", "dp", "dp_cp")] == ["none", "dp", "none", "dp", "dp_cp"]
    for bad in ("fsdp", "DP", 1, None):
        with pytest.raises(UserInputError, match=r"shard_params=.*choose one of none, dp, dp_cp"):
            check_sharding(bad)
    with pytest.raises(UserInputError, match="needs a mesh"):
        Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=BUDGET, shard_params="dp_cp")
    spec = ModelSpec(
        source=checkpoint, dtype="float64", max_tokens_per_rank=BUDGET, trainer_options={"shard_params": "x"}
    )
    with pytest.raises(UserInputError, match=r"trainer_options.shard_params='x': choose one of none, dp, dp_cp"):
        RankExecutor(spec, None)
    parser = build_parser()
    assert parser.parse_args(["serve"]).shard_params == "none"
    assert parser.parse_args(["serve", "--shard-params", "dp_cp"]).shard_params == "dp_cp"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--shard-params", "zero3"])


# ------------------------------------------------------------------------------ checkpoints, export, snapshots

# (DP, CP, shard_params, the checkpoint it loads): dp_cp's own (same layout, another dp_cp layout, dp, replicated)
# and the replicated trainer's (saved by each (1, 1) replica as "none<rank>"; replica 0's is loaded).
RELOADS = ((2, 2, "dp_cp", "dp_cp"), (1, 4, "dp_cp", "dp_cp"), (2, 1, "dp", "dp_cp"), (1, 1, "none", "dp_cp"))
RELOADS_NONE = ((2, 2, "dp_cp", "none0"),)


def _trainer(ctx, root: str, dp: int, cp: int, shard: str) -> Trainer:
    return Trainer(
        load_hf(root, dtype=torch.float64), ctx.mesh(dp=dp, cp=cp), max_tokens_per_rank=BUDGET, shard_params=shard
    )


def checkpoint_case(ctx, *, root: str, directory: str):
    """Step 1, save, step 2 under dp_cp (2, 2) and replicated (1, 1); every reload then runs step 2 alone.

    Returns (on global rank 0) the continued runs' step-2 weights, each reload's step-2 weights and step, the
    HF export and a sampler snapshot of the dp_cp trainer after step 2.
    """
    loss_fn = "cross_entropy"
    out: dict = {}
    for shard, dp, cp, name in (("dp_cp", 2, 2, "dp_cp"), ("none", 1, 1, f"none{ctx.rank}")):
        trainer = _trainer(ctx, root, dp, cp, shard)
        vocab = trainer.model.config.vocab_size
        data_a, data_b = make_data(LENS_A, loss_fn, vocab, seed=1), make_data(LENS_B, loss_fn, vocab, seed=2)
        trainer.forward_backward(data_a, loss_fn)
        trainer.optim_step(ADAM)
        trainer.forward(data_a, loss_fn)  # leaves the root unsharded: save must reshard
        trainer.save_state(f"{directory}/{name}", extra={"layout": name})
        trainer.forward_backward(data_b, loss_fn)
        trainer.optim_step(ADAM)
        out[shard] = _weights(trainer)
        if shard == "dp_cp":
            trainer.forward(data_a, loss_fn)  # the root unsharded again: export and snapshot must see the shards
            trainer.export_hf(f"{directory}/hf_dp_cp")
            out["snapshot"] = {n: t.clone() for n, t in snapshot_of(trainer.model).state_dict().items()}
    torch.distributed.barrier()  # every replica's checkpoint is published
    for dp, cp, shard, source in RELOADS + RELOADS_NONE:
        trainer = _trainer(ctx, root, dp, cp, shard)
        extra = trainer.load_state(f"{directory}/{source}")
        step = trainer.step
        trainer.forward_backward(make_data(LENS_B, loss_fn, trainer.model.config.vocab_size, seed=2), loss_fn)
        trainer.optim_step(ADAM)
        out[dp, cp, shard, source] = (_weights(trainer), step, extra)
    if ctx.rank == 0:
        out["export"] = {
            n: t.clone() for n, t in load_hf(f"{directory}/hf_dp_cp", dtype=torch.float64).state_dict().items()
        }
        return out
    return None


def test_dp_cp_checkpoints_reload_in_any_layout(pool4, checkpoint, tmp_path):
    out = pool4.run(checkpoint_case, root=checkpoint, directory=str(tmp_path))[0]
    continued = out["dp_cp"]
    assert max_diff(out["none"], continued) <= 1e-10  # the two uninterrupted runs agree
    for dp, cp, shard, source in RELOADS + RELOADS_NONE:
        weights, step, extra = out[dp, cp, shard, source]
        assert step == 1 and extra == {"layout": source}, (dp, cp, shard, source)
        # Same layout and checkpoint: the same operations on the same values, bit for bit. Else within 1e-10.
        same = (dp, cp, shard, source) == (2, 2, "dp_cp", "dp_cp")
        assert max_diff(weights, continued) <= (0.0 if same else 1e-10), (dp, cp, shard, source)
    assert max_diff(out["snapshot"], continued) == 0.0
    assert max_diff(out["export"], continued) == 0.0


def mixed_case(ctx, *, root: str):
    """bf16-mixed at (2, 2) under dp and dp_cp: the layers' FSDP policies, dtypes, log-probs and gradients."""
    results = {}
    for shard in ("dp", "dp_cp"):
        model = load_hf(root, dtype=torch.float32)
        trainer = Trainer(
            model, ctx.mesh(dp=2, cp=2), max_tokens_per_rank=BUDGET, shard_params=shard, compute_dtype=torch.bfloat16
        )
        data = make_data(LENS_B, "cross_entropy", model.config.vocab_size, seed=2)
        result = trainer.forward_backward(data, "cross_entropy")
        policies = set()
        for unit in trainer.fsdp_units[:-1]:  # the layers; the root keeps float32
            group = unit._get_fsdp_state()._fsdp_param_group
            policies |= {(fp.param_dtype, fp.reduce_dtype) for fp in group.fsdp_params}
        grads = {n: _full(q.grad) for n, q in trainer.model.named_parameters()}
        trainer.optim_step(ADAM)
        moments = {v.dtype for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"}
        if trainer.is_result_rank:
            results[shard] = {
                "logprobs": torch.cat([o["logprobs"] for o in result.outputs]),
                "grads": grads,
                "policies": policies,
                "dtypes": moments | {q.dtype for q in trainer.params} | {g.dtype for g in grads.values()},
            }
    return results


def test_bf16_mixed_dp_cp_matches_dp(pool4, checkpoint):
    runs = pool4.run(mixed_case, root=checkpoint)[0]
    dp, dp_cp = runs["dp"], runs["dp_cp"]
    assert dp_cp["policies"] == dp["policies"] == {(torch.bfloat16, torch.float32)}
    assert dp_cp["dtypes"] == {torch.float32}
    # Same float32 masters all-gathered and cast to bf16 the same way: the forward is the same, bit for bit.
    assert torch.equal(dp_cp["logprobs"], dp["logprobs"])
    # The gradients differ only in the order of the float32 SUMs over the four ranks (one reduce-scatter vs a
    # reduce-scatter over DP then an all-reduce over CP): a few float32 roundings of each summed entry.
    for name, want in dp["grads"].items():
        got = dp_cp["grads"][name]
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), name
