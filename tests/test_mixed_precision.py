"""Mixed precision (``bf16-mixed``: float32 masters, bfloat16 decoder layers) on the tiny Qwen3.5.

Single process: parameters, gradients and AdamW moments stay float32 while the layers really compute in
bfloat16; log-probs, loss and gradients sit within bf16 noise of float32 (and no farther than the all-bfloat16
model); every recomputation mode gives the same numbers; HF export writes the checkpoint's original dtype; DCP
checkpoints keep float32 masters and moments and resume bit-identically; bad names are user errors.
Four ranks: CP=2 and DP×CP 2×2 with FSDP2 (``MixedPrecisionPolicy``) match CP=1 mixed within bf16 noise.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from support.tiny_models import hf_model
from test_engine import ADAM, make_data
from torch.distributed.tensor import DTensor

from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.precision import PRECISIONS, check_compute_dtype, check_precision, set_compute_dtype
from ringtune.models.shard import shard_of
from ringtune.sample.pool import snapshot_of
from ringtune.worker.executor import DTYPES, ModelSpec, RankExecutor, trainer_dtype_options

LENS = (2, 17, 5, 40, 3, 9, 2, 13)
BUDGET = 48  # per-rank tokens: several microbatches per call
BF16 = torch.bfloat16

# Log-probs of the tiny model are O(5) nats; bfloat16 keeps 8 significant bits (unit roundoff u = 2^-9 = 2e-3),
# and each of the 4 layers rounds its input, weights and outputs to it, so a log-prob may move by a few u times
# its magnitude: 0.05 is ~5 u · |lp|. Measured: mixed 1.7e-3 max, all-bfloat16 ~1e-2.
LOGPROB_ATOL = 0.05
# Gradients are formed in bfloat16 inside a layer (8 bits), then summed in float32: a relative error of a few u
# per tensor, more for small tensors whose entries cancel. Measured max 0.02 (norm-relative, per tensor).
GRAD_RTOL = 0.1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "qwen3_5"
    hf_model("qwen3_5", seed=21).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint_bf16(tmp_path_factory):
    """The same model saved in bfloat16 (an HF checkpoint whose original dtype is bfloat16)."""
    path = tmp_path_factory.mktemp("mixed_bf16") / "qwen3_5"
    hf_model("qwen3_5", seed=21).to(BF16).save_pretrained(path)
    return str(path)


def _trainer(root: str, precision: str, **kwargs) -> Trainer:
    p = check_precision(precision)
    compute = trainer_dtype_options(p)
    return Trainer(load_hf(root, dtype=p.param_dtype), None, max_tokens_per_rank=BUDGET, **compute, **kwargs)


def _logprobs(result) -> torch.Tensor:
    return torch.cat([o["logprobs"] for o in result.outputs])


def _grad_rel(a: Trainer, b: Trainer) -> float:
    """Largest per-tensor ``|g_a - g_b| / |g_b|`` (tensors with a zero gradient skipped)."""
    worst = 0.0
    for p, q in zip(a.params, b.params, strict=True):
        ref = q.grad.double()
        if float(ref.norm()) > 0:
            worst = max(worst, float((p.grad.double() - ref).norm() / ref.norm()))
    return worst


def test_masters_moments_and_gradients_stay_float32_while_layers_compute_bf16(checkpoint):
    trainer = _trainer(checkpoint, "bf16-mixed")
    seen: dict[str, set] = {"input": set(), "weight": set(), "head_weight": set()}
    mlp = trainer.model.model.layers[0].mlp
    mlp.register_forward_hook(lambda m, args, out: seen["input"].add(args[0].dtype))
    mlp.register_forward_hook(lambda m, args, out: seen["weight"].add(m.gate_proj.weight.dtype))
    data = make_data(LENS, "cross_entropy", trainer.model.config.vocab_size)
    for _ in range(2):
        trainer.forward_backward(data, "cross_entropy")
        assert {p.grad.dtype for p in trainer.params} == {torch.float32}
        trainer.optim_step(ADAM)
    assert seen["input"] == {BF16} and seen["weight"] == {BF16}  # the layer really ran in bfloat16
    assert mlp.gate_proj.weight.dtype == torch.float32  # and the master is back in place
    assert isinstance(mlp.gate_proj.weight, torch.nn.Parameter)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    moments = [v for state in trainer.optimizer.state.values() for k, v in state.items() if k != "step"]
    assert len(moments) == 2 * len(trainer.params)
    assert {m.dtype for m in moments} == {torch.float32}
    assert trainer.model.output_weight.dtype == torch.float32  # the head reads the float32 weight
    # Sampling snapshots compute as the trainer does: layers in bfloat16, head in float32 (docs/sampling.md).
    snap = snapshot_of(trainer.model)
    assert snap.output_weight.dtype == torch.float32 and snap.model.norm.weight.dtype == torch.float32
    assert {p.dtype for p in snap.model.layers.parameters()} == {BF16}
    assert {layer.compute_dtype for layer in snap.model.layers} == {BF16}


def test_sampler_snapshot_runs_the_mixed_trainers_forward_bit_for_bit(checkpoint):
    """The snapshot's bf16 layer weights are the values the trainer casts its masters to at each use, so its
    prefill forward (the trainer's own forward) gives the trainer's log-probs exactly; a float32 copy would not
    (the sampler/trainer mismatch of docs/parity.md, 'KL(sampler ‖ trainer) by context depth')."""
    trainer = _trainer(checkpoint, "bf16-mixed")
    snap = snapshot_of(trainer.model)
    shard = shard_of(LENS)
    ids = torch.randint(0, 96, (shard.plan.local_len,), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1)
    with torch.no_grad():
        want = trainer.model(ids, shard, labels)
        assert torch.equal(snap(ids, shard, labels), want)
        plain = snapshot_of(trainer.model)
        set_compute_dtype(plain.float(), None)  # what the sampler ran before: float32 layers
        assert float((plain(ids, shard, labels) - want).abs().max()) > 1e-4


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_mixed_is_within_bf16_noise_of_float32(checkpoint, loss_fn):
    runs = {name: _trainer(checkpoint, name) for name in ("float32", "bf16-mixed", "bfloat16")}
    vocab = runs["float32"].model.config.vocab_size
    data = make_data(LENS, loss_fn, vocab)
    results = {name: t.forward_backward(data, loss_fn) for name, t in runs.items()}
    ref = _logprobs(results["float32"])
    mixed_err = (_logprobs(results["bf16-mixed"]) - ref).abs()
    bf16_err = (_logprobs(results["bfloat16"]) - ref).abs()
    assert 1e-5 < float(mixed_err.max()) < LOGPROB_ATOL  # bf16 compute shows, within bf16 noise
    # float32 embeddings, head and residual input keep the mixed model at least as close as the all-bf16 one.
    assert float(mixed_err.mean()) <= float(bf16_err.mean())
    loss32, loss_mixed = results["float32"].metrics["loss:sum"], results["bf16-mixed"].metrics["loss:sum"]
    assert abs(loss_mixed - loss32) <= LOGPROB_ATOL * sum(LENS)  # a sum of per-token terms within the lp bound
    assert _grad_rel(runs["bf16-mixed"], runs["float32"]) < GRAD_RTOL


def test_recompute_modes_give_the_same_mixed_numbers(checkpoint):
    """The rerun casts the masters again: bit-identical log-probs, gradients within summation order."""
    data = make_data(LENS, "cross_entropy", 96)
    runs = {mode: _trainer(checkpoint, "bf16-mixed", recompute=mode) for mode in ("none", "full", "selective")}
    results = {mode: t.forward_backward(data, "cross_entropy") for mode, t in runs.items()}
    for mode in ("full", "selective"):
        assert torch.equal(_logprobs(results[mode]), _logprobs(results["none"]))
        # selective splits an attention layer at its core: autograd may add a tensor's two gradient
        # contributions in another order, which in bfloat16 can round one ulp (2^-8 relative) differently.
        assert _grad_rel(runs[mode], runs["none"]) < 1e-2


def test_export_writes_the_checkpoints_original_dtype(checkpoint, checkpoint_bf16, tmp_path):
    mixed = _trainer(checkpoint_bf16, "bf16-mixed")
    assert mixed.model.output_weight.dtype == torch.float32  # float32 masters from a bfloat16 checkpoint
    mixed.forward_backward(make_data(LENS, "cross_entropy", 96), "cross_entropy")
    mixed.optim_step(ADAM)
    mixed.export_hf(str(tmp_path / "mixed"))
    tensors = load_file(tmp_path / "mixed" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {BF16}
    masters = mixed.model.state_dict()
    assert all(torch.equal(t, masters[n].to(BF16)) for n, t in tensors.items())  # the masters rounded once
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    # A float32 checkpoint exports float32 in mixed mode, and plain float32 is unchanged.
    for name in ("bf16-mixed", "float32"):
        _trainer(checkpoint, name).export_hf(str(tmp_path / name))
        assert {t.dtype for t in load_file(tmp_path / name / "model.safetensors").values()} == {torch.float32}


def test_dcp_checkpoint_keeps_float32_masters_and_moments_and_resumes(checkpoint, tmp_path):
    data = make_data(LENS, "cross_entropy", 96)
    first = _trainer(checkpoint, "bf16-mixed")
    first.forward_backward(data, "cross_entropy")
    first.optim_step(ADAM)
    first.save_state(str(tmp_path / "step1"))
    first.forward_backward(data, "cross_entropy")
    first.optim_step(ADAM)
    resumed = _trainer(checkpoint, "bf16-mixed")
    resumed.load_state(str(tmp_path / "step1"))
    assert {p.dtype for p in resumed.params} == {torch.float32}
    assert {v.dtype for s in resumed.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    resumed.forward_backward(data, "cross_entropy")
    resumed.optim_step(ADAM)
    for (name, a), b in zip(first.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name  # same masters, moments and bf16 compute: bit-identical step 2
    # A bfloat16 run cannot take the float32 masters (another model): a user error, nothing changed.
    other = _trainer(checkpoint, "bfloat16")
    with pytest.raises(UserInputError, match="float32"):
        other.load_state(str(tmp_path / "step1"))


def test_precision_names_are_checked(checkpoint):
    assert list(PRECISIONS) == ["float32", "bfloat16", "float64", "bf16-mixed", "bf16-exact"]
    assert DTYPES["bf16-mixed"] == torch.float32
    for bad in ("bf16", "float16", None, 32):
        with pytest.raises(UserInputError, match=r"dtype=.*choose one of float32, bfloat16, float64, bf16-mixed"):
            check_precision(bad)
    with pytest.raises(UserInputError, match="dtype='fp8'"):
        RankExecutor(ModelSpec(source=checkpoint, dtype="fp8", max_tokens_per_rank=BUDGET), None)
    model = load_hf(checkpoint, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 master"):
        check_compute_dtype(model, BF16)
    assert check_compute_dtype(model, torch.float64) is None  # same dtype: not mixed


# ------------------------------------------------------------------------------------------- four ranks

LAYOUTS = ((1, 1, False), (1, 2, False), (2, 2, True))  # (DP, CP, shard_params); CP=1 mixed is the reference


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def mixed_layouts_case(ctx, *, root: str):
    """Each layout in bf16-mixed (and CP=1 float32 as the bf16-noise yardstick); result ranks report."""
    results = {}
    for dp, cp, shard, precision in ((1, 1, False, "float32"), *((*lay, "bf16-mixed") for lay in LAYOUTS)):
        p = check_precision(precision)
        compute = trainer_dtype_options(p)
        mesh = ctx.mesh(dp=dp, cp=cp)
        model = load_hf(root, dtype=p.param_dtype)
        trainer = Trainer(model, mesh, max_tokens_per_rank=BUDGET, shard_params=shard, **compute)
        data = make_data(LENS, "cross_entropy", model.config.vocab_size)
        result = trainer.forward_backward(data, "cross_entropy")
        grads = {n: _full(q.grad) for n, q in trainer.model.named_parameters()}
        if not shard:
            for g in grads.values():
                dist.all_reduce(g, group=trainer.dp_cp_group)
        policies = []
        if shard:
            for unit in trainer.fsdp_units:
                group = unit._get_fsdp_state()._fsdp_param_group
                policies.append({(fp.param_dtype, fp.reduce_dtype) for fp in group.fsdp_params})
        grad_dtypes = {q.grad.dtype for q in trainer.params}
        norm = trainer.optim_step(ADAM)["grad_norm:mean"]
        after = trainer.forward(data, "cross_entropy")
        moments = {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"}
        if trainer.is_result_rank:
            results[dp, cp, precision] = {
                "logprobs": _logprobs(result),
                "after": _logprobs(after),
                "grads": grads,
                "norm": norm,
                "policies": policies,
                "dtypes": grad_dtypes | moments | {q.dtype for q in trainer.params},
                "sharded": all(isinstance(q, DTensor) for q in trainer.params),
            }
    return results


def test_cp_and_fsdp_mixed_match_cp1_mixed(pool4, checkpoint):
    runs = {k: v for res in pool4.run(mixed_layouts_case, root=checkpoint) for k, v in res.items()}
    ref, fp32 = runs[1, 1, "bf16-mixed"], runs[1, 1, "float32"]
    for key in ((1, 2, "bf16-mixed"), (2, 2, "bf16-mixed")):
        run = runs[key]
        assert run["dtypes"] == {torch.float32}, key
        # CP changes only the order of float32 sums inside attention / the GDN scan; each may flip one bf16
        # rounding of a layer's activations, i.e. the same kind of error bf16 compute adds against float32.
        # Bound: 3x the bf16-vs-float32 difference at CP=1 (the yardstick, measured here; CP measured 0.7x of it
        # before the step, 1.7x after). After the step the yardstick is the post-step difference: AdamW divides by
        # sqrt(v), so an entry whose gradient is near zero moves by up to lr either way under any noise, bf16's as
        # CP's. (A gradient reduction bug is caught by the gradient and grad-norm checks below: Adam's update
        # does not see a gradient's scale.)
        for part in ("logprobs", "after"):
            noise = float((ref[part] - fp32[part]).abs().max())
            diff = float((run[part] - ref[part]).abs().max())
            assert diff <= 3 * noise, (key, part, diff, noise)
        for name, g in ref["grads"].items():
            scale = float(g.norm())
            if scale > 0:
                assert float((run["grads"][name] - g).norm()) / scale < GRAD_RTOL, (key, name)
        assert abs(run["norm"] - ref["norm"]) / ref["norm"] < GRAD_RTOL
    fsdp = runs[2, 2, "bf16-mixed"]
    assert fsdp["sharded"]
    *layers, root = fsdp["policies"]
    assert all(p == {(BF16, torch.float32)} for p in layers)  # MixedPrecisionPolicy(bf16, reduce float32)
    assert root == {(None, None)}  # the root (embeddings, final norm, head) keeps float32


def test_serve_backend_and_flag_take_bf16_mixed(checkpoint):
    """``ringtune serve --dtype bf16-mixed``: the flag parses, the backend reports it and its runs train mixed."""
    from ringtune.cli import build_parser
    from ringtune.gateway.local import LocalBackend

    assert build_parser().parse_args(["serve", "--dtype", "bf16-mixed"]).dtype == "bf16-mixed"
    with pytest.raises(SystemExit):  # argparse refuses a name outside the registry (exit 2, choices listed)
        build_parser().parse_args(["serve", "--dtype", "bf16"])
    backend = LocalBackend(checkpoint, max_tokens_per_rank=BUDGET, dtype="bf16-mixed")
    try:
        assert backend.info().dtype == "bf16-mixed"
        backend.create_run("run", checkpoint)
        trainer = backend.trainers["run"]
        assert trainer.compute_dtype == BF16
        assert {p.dtype for p in trainer.params} == {torch.float32}
        assert all(layer.compute_dtype == BF16 for layer in trainer.model.model.layers)
    finally:
        backend.close()
