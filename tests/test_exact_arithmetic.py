"""``bf16-exact``: bfloat16 values, float64 arithmetic (ringtune.models.precision).

Under ``bf16-mixed`` a token's log-prob depends on how it was computed: one-token decode or packed forward, the
row's other datums, the CP layout, since the CPU kernels round a bf16 sum differently by batch shape
(docs/parity.md, "KL(sampler ‖ trainer) by context depth"). ``bf16-exact`` rounds the same values to bfloat16
but computes between them in float64, so every rounded value is the correctly rounded result and the bits agree
whatever the path. What is left is the float32 head (embeddings, final norm and head stay float32, as under
``bf16-mixed``): its logits and log-sum-exp round in float32, so a log-prob of magnitude ~5 may differ by a few
float32 ulps (2^-21 ≈ 5e-7 each at that size); 1e-5 bounds that with room. Under ``bf16-mixed`` the same
comparisons differ by 1e-4 to 1e-2 (bf16's 2^-9 ≈ 2e-3 per rounding, accumulated over the layers).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.lora import randomize_adapters
from support.tiny_models import hf_model
from test_engine import ADAM, make_data
from test_mixed_precision import _full

from ringtune.engine.batch import TrainDatum
from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.trainer import Trainer
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.lora import LoraModel, LoraSpec
from ringtune.models.precision import PRECISIONS, check_precision, frozen_rounded, layers_exact
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import snapshot_of
from ringtune.sample.sampler import generate
from ringtune.worker.executor import trainer_dtype_options

HEAD_ATOL = 1e-5  # float32 head rounding only (module docstring)
BF16_MIN = 1e-4  # bf16-mixed moves at least this much on the same comparison (measured 3e-4 to 4e-3)
PROMPT_LENS = (5, 17, 40)
LENS = (2, 17, 5, 40, 3, 9, 2, 13)
BUDGET = 48


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    roots = {}
    for family in ("llama", "qwen3_5", "qwen3_5_moe"):
        path = tmp_path_factory.mktemp("exact") / family
        hf_model(family, seed=5).save_pretrained(path)
        roots[family] = str(path)
    return roots


def _trainer(root: str, precision: str, mesh=None, budget: int = BUDGET, **kwargs) -> Trainer:
    p = check_precision(precision)
    options = trainer_dtype_options(p)
    return Trainer(load_hf(root, dtype=p.param_dtype), mesh, max_tokens_per_rank=budget, **options, **kwargs)


def _sampled_vs_trainer(root: str, precision: str) -> tuple[float, int]:
    """Sample 2 × 12 tokens after each of three prompts from the trainer's snapshot, then forward every prompt +
    completion in one ``forward`` call (the datums share rows); largest |sampled − trainer| log-prob, tokens."""
    trainer = _trainer(root, precision, budget=64)  # rows of 64: the 17- to 51-token datums share them
    sampler = snapshot_of(trainer.model)
    assert layers_exact(sampler) == check_precision(precision).exact
    return _compare(trainer, sampler)


def _compare(trainer: Trainer, sampler) -> tuple[float, int]:
    """:func:`_sampled_vs_trainer` for a given trainer and sampler model."""
    gen = torch.Generator().manual_seed(1)
    vocab = trainer.model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=0, stop=())
    with torch.inference_mode():
        results = generate(sampler, prompts, params, num_samples=2)
    data, sampled, starts = [], [], []
    for prompt, result in zip(prompts, results, strict=True):
        for seq in result.sequences:
            full = prompt + seq.tokens
            inputs = {"target_tokens": torch.tensor(full[1:]), "weights": torch.zeros(len(full) - 1)}
            data.append(TrainDatum(torch.tensor(full[:-1]), inputs))
            sampled.append(torch.tensor(seq.logprobs, dtype=torch.float64))
            starts.append(len(prompt) - 1)
    outputs = trainer.forward(data, "cross_entropy").outputs
    diffs = [
        (out["logprobs"].double()[start:] - lp).abs() for out, lp, start in zip(outputs, sampled, starts, strict=True)
    ]
    return float(torch.cat(diffs).max()), sum(len(d) for d in diffs)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_decode_equals_the_packed_forward(checkpoints, family):
    """The sampler's decode log-probs equal the trainer's packed forward to float32 head rounding (bf16-mixed:
    not), on attention, GatedDeltaNet (recurrent decode vs chunked scan) and MoE layers."""
    exact, n = _sampled_vs_trainer(checkpoints[family], "bf16-exact")
    mixed, _ = _sampled_vs_trainer(checkpoints[family], "bf16-mixed")
    print(f"\n{family}: max |sampled - trainer| over {n} tokens: bf16-exact {exact:.1e}, bf16-mixed {mixed:.1e}")
    assert exact <= HEAD_ATOL
    assert mixed >= BF16_MIN  # the comparison does see bf16 path differences


def test_lora_decode_equals_the_packed_forward_on_a_frozen_rounded_base(checkpoints):
    """A LoRA run under bf16-exact: its adapter snapshot decodes on the shared float32 base to the trainer's packed
    forward within float32 head rounding; the base's layer weights are rounded once into a float64 copy that every
    forward and decode step reuses (``precision.frozen_rounded``), the float32 base itself unchanged."""
    p = check_precision("bf16-exact")
    base = load_hf(checkpoints["qwen3_5"], dtype=p.param_dtype)
    lora = LoraModel(base, LoraSpec(rank=4))
    randomize_adapters(lora, seed=3)
    trainer = LoraTrainer(lora, None, max_tokens_per_rank=64, **trainer_dtype_options(p))
    worst, n = _compare(trainer, trainer.sampler_snapshot())
    print(f"\nLoRA qwen3_5: max |sampled - trainer| over {n} tokens: bf16-exact {worst:.1e}")
    assert worst <= HEAD_ATOL
    weight = base.model.layers[3].self_attn.o_proj.weight
    assert weight.dtype == torch.float32 and not weight.requires_grad
    _, rounded = weight._ringtune_rounded
    assert rounded.dtype == torch.float64 and torch.equal(rounded, weight.bfloat16().double())
    data = make_data(LENS, "cross_entropy", base.config.vocab_size)
    trainer.forward_backward(data, "cross_entropy")
    assert weight._ringtune_rounded[1] is rounded  # reused, not made again
    with torch.no_grad():
        weight.mul_(2)  # an in-place write (as a load) makes a new rounding
    assert frozen_rounded(weight, torch.bfloat16, torch.float64) is not rounded


def test_exact_layers_store_bf16_values_and_train_float32_masters(checkpoints):
    trainer = _trainer(checkpoints["qwen3_5"], "bf16-exact")
    seen: dict[str, set] = {"input": set(), "weight": set()}
    proj = trainer.model.model.layers[3].self_attn.o_proj
    proj.register_forward_hook(lambda m, args, out: seen["input"].add(args[0].dtype))
    proj.register_forward_hook(
        lambda m, args, out: seen["weight"].add(bool(torch.equal(m.weight, m.weight.bfloat16().double())))
    )
    data = make_data(LENS, "cross_entropy", trainer.model.config.vocab_size)
    trainer.forward_backward(data, "cross_entropy")
    assert {p.grad.dtype for p in trainer.params} == {torch.float32}
    trainer.optim_step(ADAM)
    assert seen == {"input": {torch.float64}, "weight": {True}}  # float64 arithmetic on bf16-rounded weights
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    snap = snapshot_of(trainer.model)  # the sampler holds the layers' bf16 values in float64 (no per-step casts)
    assert all(torch.equal(p, p.bfloat16().double()) for p in snap.model.layers.parameters()) and layers_exact(snap)
    assert {p.dtype for p in snap.model.layers.parameters()} == {torch.float64}
    assert PRECISIONS["bf16-exact"].mixed and PRECISIONS["bf16-exact"].exact


LAYOUTS = (  # (DP, CP, shard_params, attention, gated_delta); (1, 1) is the reference
    (1, 1, "none", "ring", "headwise"),
    (1, 2, "none", "ring", "chunkwise"),
    (1, 2, "none", "alltoall", "headwise"),
    (2, 2, "dp_cp", "allgather", "chunkwise"),
    (1, 4, "none", "ring", "chunkwise"),
)


def exact_layouts_case(ctx, *, root: str):
    results = {}
    for dp, cp, shard, attention, gated_delta in LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp)
        trainer = _trainer(root, "bf16-exact", mesh, shard_params=shard, attention=attention, gated_delta=gated_delta)
        data = make_data(LENS, "cross_entropy", trainer.model.config.vocab_size)
        result = trainer.forward_backward(data, "cross_entropy")
        grads = {n: _full(q.grad) for n, q in trainer.model.named_parameters()}
        if shard == "none":
            for g in grads.values():
                dist.all_reduce(g, group=trainer.dp_cp_group)
        norm = trainer.optim_step(ADAM)["grad_norm:mean"]
        after = trainer.forward(data, "cross_entropy")
        if trainer.is_result_rank:
            results[dp, cp, attention, gated_delta] = {
                "logprobs": torch.cat([o["logprobs"] for o in result.outputs]),
                "after": torch.cat([o["logprobs"] for o in after.outputs]),
                "grads": grads,
                "norm": norm,
            }
    return results


def test_cp_layouts_and_fsdp_equal_one_rank(pool4, checkpoints):
    """bf16-exact at CP 2 and 4 (every attention and GDN mode) and under FSDP gives CP=1's log-probs to float32
    head rounding, before and after an AdamW step; gradients to float32 summation (each rank's share reaches the
    float32 master unrounded, and the shares add in float32: ~1e-6 relative). bf16-mixed differs from CP=1 by
    bf16 noise here (tests/test_mixed_precision.py bounds it by 3x the bf16-vs-float32 difference)."""
    runs = {k: v for res in pool4.run(exact_layouts_case, root=checkpoints["qwen3_5"]) for k, v in res.items()}
    ref = runs[1, 1, "ring", "headwise"]
    for key, run in runs.items():
        lp = [float((run[part] - ref[part]).abs().max()) for part in ("logprobs", "after")]
        grad = max(
            float((run["grads"][name] - g).norm() / g.norm()) for name, g in ref["grads"].items() if g.norm() > 0
        )
        norm = abs(run["norm"] - ref["norm"]) / ref["norm"]
        print(f"\n{key}: |dlp| before {lp[0]:.1e} after {lp[1]:.1e}; rel. grad {grad:.1e}; grad norm {norm:.1e}")
        assert max(lp) <= HEAD_ATOL and grad < 1e-5 and norm < 1e-6, key


def test_serve_takes_bf16_exact(checkpoints):
    """``ringtune serve --dtype bf16-exact`` parses; the backend's runs and samplers compute exact."""
    from ringtune.cli import build_parser
    from ringtune.gateway.local import LocalBackend

    assert build_parser().parse_args(["serve", "--dtype", "bf16-exact"]).dtype == "bf16-exact"
    backend = LocalBackend(checkpoints["llama"], max_tokens_per_rank=BUDGET, dtype="bf16-exact")
    try:
        assert backend.info().dtype == "bf16-exact"
        backend.create_run("run", checkpoints["llama"])
        trainer = backend.trainers["run"]
        assert trainer.compute_dtype == torch.bfloat16 and trainer.exact_arithmetic
        assert layers_exact(trainer.model)
    finally:
        backend.close()
