"""``ringtune plan``: the activation inventory against autograd's saved tensors, parameter counts, one measured
step, the ranking, and the command line's errors."""

from __future__ import annotations

import json

import pytest
import torch
from support.profiled_memory import tensor_peak_bytes

from ringtune.cli import main
from ringtune.engine.batch import TrainDatum
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.models.precision import check_precision
from ringtune.models.shard import shard_of
from ringtune.plan import activations as act
from ringtune.plan.estimate import Layout, estimate, layer_parameters, root_parameters, snapshot_bytes
from ringtune.plan.grad_overlap import add_reduced_gradients
from ringtune.plan.search import plan_layouts
from ringtune.worker.executor import trainer_dtype_options

# Distinct sizes so that a term counted with the wrong dimension shows (no two of them equal, none = 64).
TINY = {
    "model_type": "qwen3_5_text",
    "vocab_size": 1000,
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 24,
    "linear_value_head_dim": 40,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
CFG = DecoderConfig.from_hf(TINY)


def saved_bytes(root: torch.Tensor, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saved in the graph behind ``root`` (parameters excluded)."""
    seen: dict[int, int] = {}
    stack, visited = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:
                    continue
                values = value if isinstance(value, tuple | list) else (value,)
                tensors += [t for t in values if isinstance(t, torch.Tensor)]
        if hasattr(node, "saved_tensors"):
            tensors += [t for t in node.saved_tensors if t is not None]
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in exclude:
                seen[st.data_ptr()] = st.nbytes()
        stack.extend(nxt for nxt, _ in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", [0, 1])
def test_layer_inventory_matches_autograd(dtype: torch.dtype, index: int) -> None:
    torch.manual_seed(0)
    model = CausalLM(CFG).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = 1280
    shard = shard_of([tokens])
    x = torch.randn(tokens, CFG.hidden_size, dtype=dtype, requires_grad=True)
    layer = model.model.layers[index]
    counted = saved_bytes(layer(x, shard), params) / tokens
    e = torch.finfo(dtype).bits // 8
    predicted = act.layer_saved(CFG, layer.layer_type, act.Widths(e=e, a=4))
    # The inventory leaves out per-sequence edge terms (the conv's first K-1 tokens, the scan's first step
    # that starts from no state, the [C, C] mask): about 130 bytes per token here at 20 chunks, 0.5%.
    assert predicted == pytest.approx(counted, rel=0.01)


def test_parameter_counts() -> None:
    for tied in (True, False):
        cfg = DecoderConfig.from_hf({**TINY, "tie_word_embeddings": tied})
        model = CausalLM(cfg)
        want = sum(p.numel() for p in model.parameters())
        assert sum(layer_parameters(cfg, t) for t in cfg.layer_types) + root_parameters(cfg) == want


def test_sampler_snapshots_are_whole_models_in_the_samplers_dtypes() -> None:
    """A snapshot is the whole model on every rank (FSDP and EP gather it): float32 4 bytes a parameter, bf16-mixed
    bf16 decoder layers with a float32 root; ``sampler_snapshots`` adds that many to every phase's peak."""
    cfg = DecoderConfig.from_hf(TINY)
    model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    root = root_parameters(cfg)
    sharded = Layout(cp=2, dp=2, shard="dp_cp", recompute="none", precision="float32")
    assert snapshot_bytes(cfg, sharded) == 4 * total
    mixed = Layout(cp=1, dp=1, shard="none", recompute="none", precision="bf16-mixed")
    assert snapshot_bytes(cfg, mixed) == 2 * (total - root) + 4 * root
    alone, held = estimate(cfg, sharded, 256), estimate(cfg, sharded, 256, sampler_snapshots=3)
    assert held.peak - alone.peak == pytest.approx(3 * 4 * total) and held.phase == alone.phase
    with pytest.raises(UserInputError, match="--sampler-snapshots=-1: must be an integer >= 0"):
        estimate(cfg, sharded, 256, sampler_snapshots=-1)


def test_reduced_gradient_copy_is_counted_where_backward_reduces() -> None:
    """Replicated at DP·CP > 1 (engine/grad_overlap.py): a ``reduced gradients`` phase of one whole copy of the
    trainable parameters in their dtype (float32 masters under bf16-mixed), and in each layer's phase the buckets
    of the layers after it and of the head side; none when sharded or on one rank."""
    cfg = DecoderConfig.from_hf(TINY)
    total = sum(p.numel() for p in CausalLM(cfg).parameters())
    for precision in ("float32", "bf16-mixed"):
        got = estimate(cfg, Layout(cp=2, dp=1, shard="none", recompute="none", precision=precision), 64)
        assert got.detail["phase reduced gradients"] == 4 * total
    for layout in (Layout(cp=1, dp=1, shard="none", recompute="none", precision="float32"),
                   Layout(cp=1, dp=2, shard="dp", recompute="none", precision="float32")):  # fmt: skip
        assert "phase reduced gradients" not in estimate(cfg, layout, 64).detail
    phases = {"head": (1.0, 0.0, 0.0), "layer 1": (5.0, 1.0, 2.0), "layer 0": (7.0, 1.0, 3.0)}
    add_reduced_gradients(phases, shard="none", ep=1, ranks=2, layer_params=[10, 20], after_layers=3, whole=40,
                          param_bytes=4)  # fmt: skip
    assert phases == {"head": (1.0, 0.0, 0.0), "layer 1": (5.0, 1.0, 2.0 + 4 * 3), "layer 0": (7.0, 1.0, 3.0 + 4 * 23),
                      "reduced gradients": (0.0, 0.0, 160.0)}  # fmt: skip
    before = dict(phases)
    add_reduced_gradients(phases, shard="none", ep=2, ranks=2, layer_params=[10, 20], after_layers=3, whole=40,
                          param_bytes=4)  # fmt: skip
    assert phases == before  # EP > 1 reduces at optim_step


@pytest.mark.parametrize(("precision", "adamw"), [("float32", "torch_default"), ("bf16-mixed", "fused")])
def test_measured_step_within_tolerance(precision: str, adamw: str) -> None:
    """One Trainer step (forward_backward + optim_step, CP 1, recompute none) of the tiny model vs the prediction;
    also in bf16-mixed with fused AdamW, the GPU default (its head and norm in float32, its layers in bf16)."""
    recompute = "none"
    torch.manual_seed(0)
    model = CausalLM(CFG)
    tokens = 4096
    options = trainer_dtype_options(check_precision(precision))
    trainer = Trainer(model, None, max_tokens_per_rank=tokens + 8, recompute=recompute, adamw_kernel=adamw, **options)
    gen = torch.Generator().manual_seed(0)

    def datum(n: int) -> TrainDatum:
        ids, targets = torch.randint(0, CFG.vocab_size, (2, n), generator=gen)
        return TrainDatum(tokens=ids, inputs={"target_tokens": targets, "weights": torch.ones(n, dtype=torch.float64)})

    trainer.forward_backward([datum(64)], "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-5))
    before = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights and two AdamW moments, float32
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with prof:
        trainer.forward_backward([datum(tokens)], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-5))
    measured = before + tensor_peak_bytes(prof)
    est = estimate(CFG, Layout(cp=1, dp=1, shard="none", recompute=recompute, precision=precision), tokens, adamw=adamw)
    print(f"\n{precision}: predicted / measured {est.peak / measured:.3f}")
    # benchmarks/plan_check.py's goal (10%); measured 0.999 here in float32, 1.011 in bf16-mixed (the head is small
    # at vocab 1000: plan_check's 8K row at vocab 32K is where bf16-mixed's head accounting showed). The peak is at
    # the head's backward (every layer's kept activations + one logits tile): the inventory and the tile rule.
    assert est.phase == "head"
    assert est.peak == pytest.approx(measured, rel=0.10)


def test_ranking_fits_first_and_cheapest() -> None:
    planned = plan_layouts(CFG, context=8192, gpus=4, memory=2**30)
    assert planned[0].fits_with_margin
    fitting = [p for p in planned if p.fits_with_margin]
    assert [p.cost for p in fitting] == sorted(p.cost for p in fitting)
    assert all(p.estimate.peak <= 0.9 * 2**30 for p in fitting)
    assert {p.estimate.layout.cp * p.estimate.layout.dp for p in planned} == {4}
    # Sharding over DP (or DP·CP) divides the optimizer state by DP (DP·CP); recompute full keeps less than none.
    by = {
        (p.estimate.layout.cp, p.estimate.layout.shard, p.estimate.layout.recompute, p.estimate.layout.precision): p
        for p in planned
    }
    replicated = by[1, "none", "none", "float32"].estimate
    assert by[1, "dp", "none", "float32"].estimate.moments == pytest.approx(replicated.moments / 4)
    assert by[2, "dp", "none", "float32"].estimate.moments == pytest.approx(replicated.moments / 2)
    for cp in (2, 4):  # dp_cp: parameters, gradients and moments over all 4 ranks, the same at any CP
        got = by[cp, "dp_cp", "none", "float32"].estimate
        assert got.moments == pytest.approx(replicated.moments / 4)
        assert (got.parameters, got.gradients) == pytest.approx(
            (by[1, "dp", "none", "float32"].estimate.parameters, by[1, "dp", "none", "float32"].estimate.gradients)
        )
    assert (1, "dp_cp", "none", "float32") not in by and (4, "dp", "none", "float32") not in by  # = dp / shards nothing
    # (compared where every layer's kept activations are alive: the start of the backward, the head phase)
    kept = {r: by[2, "none", r, "float32"].estimate.detail["phase head"] for r in ("none", "full")}
    assert kept["full"] < kept["none"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "Qwen3.5-9000B"], ["--model='Qwen3.5-9000B'", "Qwen3.5-4B"]),
        (["--gpu-memory", "80"], ["--gpu-memory='80'", "80GiB"]),
        (["--gpu-memory", "80XB"], ["--gpu-memory='80XB'", "units"]),
        (["--gpus", "0"], ["--gpus=0", "> 0"]),
        (["--context-length", "-5"], ["--context-length=-5", "> 0"]),
        (["--precision", "fp8"], ["--precision='fp8'", "bf16-mixed"]),
        (["--precision", "bf16-exact"], ["--precision='bf16-exact'", "bf16-mixed", "a CPU precision"]),
        (["--recompute", "some"], ["--recompute='some'", "selective"]),
    ],
)
def test_cli_errors_name_field_value_and_limit(argv: list[str], words: list[str], capsys) -> None:
    base = {"--model": "Qwen3.5-4B", "--context-length": "131072", "--gpus": "8", "--gpu-memory": "80GiB"}
    args = dict(base)
    args.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    flat = [x for kv in args.items() for x in kv]
    if argv[0] in ("--precision", "--recompute"):
        flat += argv
    assert main(["plan", *flat]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_cli_json_and_known_model(capsys) -> None:
    argv = ["plan", "--model", "qwen3.5-4b", "--context-length", "131072", "--gpus", "8", "--gpu-memory", "141GB"]
    code = main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["model"] == "Qwen3.5-4B" and out["gpu_memory_bytes"] == 141 * 10**9
    first = out["layouts"][0]
    assert first["fits_with_margin"] and first["peak"] <= 0.9 * 141e9
    terms = ("parameters", "gradients", "moments", "activations", "constants", "communication", "snapshots")
    assert sum(first[t] for t in terms) == pytest.approx(first["peak"])
    assert out["sampler_snapshots"] == 4 and first["snapshots"] > 0  # the sampler pool's default limit, counted
    # Nothing fits: exit 1 with the table; the JSON lists every layout, nearest to fitting first.
    small = ["plan", "--model", "Qwen3.5-27B", "--context-length", "131072", "--gpus", "2", "--gpu-memory", "8GiB"]
    assert main(small) == 1
    capsys.readouterr()
    main([*small, "--json"])
    peaks = [layout["peak"] for layout in json.loads(capsys.readouterr().out)["layouts"]]
    assert peaks == sorted(peaks)
