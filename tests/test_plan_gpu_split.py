"""ringtune.plan.gpu_split: an engine's memory per GPU by hand for a small Llama, the splits of a node between
training ranks and engines, the recommended one, the refusals, and ``ringtune plan --vllm-engines``'s output."""

from __future__ import annotations

import json

import pytest

from ringtune.cli import main
from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.plan.gpu_split import ENGINE_RUNTIME_BYTES, GIB, engine_needs, model_parameters, plan_splits, recommended
from ringtune.plan.models import resolve_model

LLAMA = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def test_engine_needs_by_hand():
    cfg = DecoderConfig.from_hf(LLAMA)
    params = model_parameters(cfg)
    per_layer = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 512 + 2 * 256  # q, o; k, v; the MLP; two norms
    assert params == 4 * per_layer + 2 * 1000 * 256 + 256
    memory = 8 * GIB
    one = engine_needs(cfg, gpus=1, gpu_memory=memory, dtype="bfloat16", sample_context=1024, utilization=0.9)
    assert one.weights == params * 2 and one.kv_per_token == 4 * 2 * 2 * 32 * 2 and one.state_per_sequence == 0
    assert one.kv_cache == 0.9 * memory - params * 2 - ENGINE_RUNTIME_BYTES
    assert one.sequences == int(one.kv_cache // (1024 * one.kv_per_token))
    four = engine_needs(cfg, gpus=4, gpu_memory=memory, dtype="float32", sample_context=1024, utilization=0.9)
    assert four.weights == params * 4 / 4 and four.kv_per_token == 4 * 2 * 1 * 32 * 4  # a KV head per GPU
    small = engine_needs(cfg, gpus=1, gpu_memory=3 * GIB, dtype="bfloat16", sample_context=1024, utilization=0.9)
    assert small.kv_cache == 0 and not small.fits  # the runtime alone is past 90 % of 3 GiB


def test_qwen35_27b_splits_a_node_and_recommends_the_fewest_engines_that_hold_the_sequences():
    _, cfg = resolve_model("Qwen3.5-27B")
    options = {"precisions": ("bf16-mixed",), "recompute": ("full",), "sampler_snapshots": 0}
    common = {"gpu_memory": 80 * GIB, "context": 32768, "engine_gpus": 2, "engine_dtype": "bfloat16"}
    splits = plan_splits(cfg, gpus=16, gpus_per_node=8, sample_context=16384, utilization=0.9, **common, **options)
    assert [s.engines for s in splits] == [2, 4, 6]  # the same count per node, a rank left on each
    assert [s.training_gpus for s in splits] == [12, 8, 4] and splits[0].ranks_per_node == 6
    needs = splits[0].needs
    assert needs.weights == model_parameters(cfg) and needs.state_per_sequence > 0  # bf16 over 2 GPUs
    assert all(s.sequences == s.engines * needs.sequences for s in splits)
    best = recommended(splits, sequences=needs.sequences * 2 + 1)  # more than 2 engines hold
    assert best is not None and best.engines == 4 and best.training_fits
    assert recommended(splits, sequences=10**6) is None
    (only,) = plan_splits(
        cfg, gpus=16, gpus_per_node=8, sample_context=16384, utilization=0.9, engines=6, **common, **options
    )
    assert only.engines == 6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gpus_per_node": 3}, "--gpus-per-node=3: must be >= 1 and divide --gpus=16"),
        ({"engine_gpus": 8}, "--vllm-tp=8"),
        ({"engines": 3}, r"--vllm-engines=3: .* choose one of \[2, 4, 6\]"),
        ({"engine_dtype": "int3"}, "--vllm-dtype='int3'"),
        ({"utilization": 1.5}, "--vllm-memory-utilization=1.5"),
    ],
)
def test_refusals_name_the_flag(overrides, message):
    cfg = DecoderConfig.from_hf(LLAMA)
    args = {
        "gpus": 16,
        "gpus_per_node": 8,
        "gpu_memory": 80 * GIB,
        "context": 4096,
        "engine_gpus": 2,
        "engine_dtype": "bfloat16",
        "sample_context": 4096,
        "utilization": 0.9,
    }
    with pytest.raises(UserInputError, match=message):
        plan_splits(cfg, **(args | overrides))


def test_plan_command_prints_the_split_and_the_serve_flags(capsys):
    argv = ["plan", "--model", "Qwen3.5-27B", "--context-length", "32768", "--gpus", "16", "--gpu-memory", "80GiB"]
    argv += ["--gpus-per-node", "8", "--precision", "bf16-mixed", "--vllm-engines", "auto", "--vllm-tp", "2"]
    argv += ["--vllm-context", "16384"]
    assert main([*argv, "--vllm-sequences", "128"]) == 0
    out = capsys.readouterr().out
    assert "engine (2 GPU(s), bfloat16) per GPU: weights 25.0 GiB" in out and "<- recommended" in out
    assert "--cp 3 --dp 4 --shard-params dp_cp --sampler vllm --vllm-engines 1 --vllm-devices 6,7" in out
    assert "attach each with --vllm-url" in out  # the other node's engine
    assert main([*argv, "--vllm-sequences", "100000"]) == 1
    assert "no split holds the sequences" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["engines"] for s in report["splits"]] == [2, 4, 6] and report["recommended"] == 2
