"""``ringtune serve``'s device defaults (``ringtune/worker/device_defaults.py``): the precision, data backend and
kernels per host, and the refusal of a CUDA setting whose attention would take the quadratic-memory ``math``
kernel at long context. Pure: every case states its host, none needs a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.ops.attention.kernels import NEEDS, select_block_kernel
from ringtune.ops.gated_delta.chunked import CHUNK_SCANS, default_chunk_scan
from ringtune.ops.gated_delta.conv import CONV_KERNELS, select_conv
from ringtune.plan.models import KNOWN_MODELS
from ringtune.worker.device_defaults import (
    QUADRATIC_SCORES_LIMIT_BYTES,
    HostFacts,
    host_facts,
    math_scores_bytes,
    resolve_device_settings,
)

QWEN35_4B = DecoderConfig.from_hf(KNOWN_MODELS["Qwen3.5-4B"])  # 16 attention heads, 8 of 32 layers full attention
CPU = HostFacts(device_type="cpu")
H100 = HostFacts(device_type="cuda", gpu_count=1, fla_installed=True)
FOUR_GPUS = HostFacts(device_type="cuda", gpu_count=4, fla_installed=True)
FLOAT32_LIMIT_TOKENS = 4096  # 16 heads x 4096^2 x 4 bytes = 1 GiB exactly: the longest budget float32 may serve


def resolve(host: HostFacts, dtype: str | None, tokens: int = 16512, world: int = 1, config=QWEN35_4B):
    return resolve_device_settings(host, dtype=dtype, config=config, world_size=world, max_tokens_per_rank=tokens)


def test_cpu_keeps_float32_gloo_and_the_cpu_kernels():
    got = resolve(CPU, None)
    assert (got.dtype, got.data_backend, got.attention_kernel, got.adamw_kernel) == (
        "float32",
        "gloo",
        "cpu_flash",
        "fused",
    )
    assert (got.gated_delta_scan, got.conv_kernel, got.head_kernel, got.notes) == ("recompute", "torch", "tiled", ())
    cpu = torch.device("cpu")  # the names the registries themselves pick on CPU
    assert got.attention_kernel == select_block_kernel(cpu, torch.float32).name
    assert got.gated_delta_scan == default_chunk_scan(cpu) and got.conv_kernel == select_conv(cpu, False)
    for dtype in ("float64", "bf16-exact", "bfloat16"):  # cpu_flash takes every dtype: nothing refused on CPU
        assert resolve(CPU, dtype, tokens=131072).dtype == dtype


def test_cuda_defaults_to_bf16_mixed_nccl_and_the_fast_kernels():
    got = resolve(H100, None)
    assert (got.dtype, got.data_backend, got.attention_kernel, got.adamw_kernel) == (
        "bf16-mixed",
        "nccl",
        "cuda_varlen",
        "fused",
    )
    assert (got.gated_delta_scan, got.conv_kernel, got.head_kernel, got.notes) == ("fla", "fla", "tiled", ())
    assert NEEDS[got.attention_kernel] == ("cuda", (torch.float16, torch.bfloat16))
    assert got.gated_delta_scan in CHUNK_SCANS and got.conv_kernel in CONV_KERNELS
    assert resolve(FOUR_GPUS, None, world=4).data_backend == "nccl"  # one GPU per rank
    assert resolve(H100, "bfloat16").attention_kernel == "cuda_varlen"  # a given flash-capable dtype is kept


@pytest.mark.parametrize("dtype", ["float32", "float64", "bf16-exact"])
def test_cuda_refuses_the_math_kernel_at_long_context_naming_the_fix(dtype):
    with pytest.raises(UserInputError) as caught:
        resolve(H100, dtype, tokens=16512)
    message = str(caught.value)
    assert f"--dtype {dtype} on CUDA" in message and "'math' kernel" in message
    assert "serve with --dtype bf16-mixed" in message and "--context-length" in message
    assert "16512 tokens per rank" in message and "limit 1 GiB" in message


def test_cuda_serves_the_math_kernel_below_the_limit_with_a_note():
    at_limit = resolve(H100, "float32", tokens=FLOAT32_LIMIT_TOKENS)
    assert math_scores_bytes(QWEN35_4B, FLOAT32_LIMIT_TOKENS, torch.float32) == QUADRATIC_SCORES_LIMIT_BYTES
    assert at_limit.dtype == "float32" and at_limit.attention_kernel == "math"
    assert any("--dtype bf16-mixed takes the flash kernel" in n for n in at_limit.notes)
    with pytest.raises(UserInputError, match="--dtype float32 on CUDA"):
        resolve(H100, "float32", tokens=FLOAT32_LIMIT_TOKENS + 8)
    with pytest.raises(UserInputError, match="computes attention in float64"):  # bf16-exact: float64 arithmetic
        resolve(H100, "bf16-exact", tokens=FLOAT32_LIMIT_TOKENS)


def test_a_model_without_full_attention_never_reaches_the_kernel():
    gdn_only = dataclasses.replace(QWEN35_4B, layer_types=("linear_attention",) * QWEN35_4B.num_layers)
    got = resolve(H100, "float32", tokens=131072, config=gdn_only)
    assert got.dtype == "float32" and got.attention_kernel == "math" and got.notes == ()


def test_ranks_sharing_a_gpu_take_gloo_and_say_so():
    got = resolve(H100, None, world=2)
    assert got.data_backend == "gloo" and got.attention_kernel == "cuda_varlen"
    (note,) = got.notes
    assert "2 ranks share 1 GPU(s)" in note and "NCCL refuses two ranks on one GPU" in note


def test_cuda_without_fla_notes_the_torch_scan_for_gated_delta_models_only():
    no_fla = HostFacts(device_type="cuda", gpu_count=1, fla_installed=False)
    got = resolve(no_fla, None)
    assert (got.gated_delta_scan, got.conv_kernel) == ("recompute", "torch")
    assert any("pip install 'ringtune[gpu]'" in n for n in got.notes)
    dense = dataclasses.replace(QWEN35_4B, layer_types=("full_attention",) * QWEN35_4B.num_layers)
    assert resolve(no_fla, None, config=dense).notes == ()


def test_bad_input_is_refused_where_it_enters():
    with pytest.raises(UserInputError, match="--dtype='fp8': choose one of"):
        resolve(CPU, "fp8")
    with pytest.raises(ValueError, match="device_type='mps'"):
        resolve(HostFacts(device_type="mps"), None)
    with pytest.raises(ValueError, match="needs gpu_count >= 1; got 0"):
        resolve(HostFacts(device_type="cuda"), None)
    with pytest.raises(ValueError, match="world_size=0"):
        resolve(CPU, None, world=0)


def test_host_facts_reads_this_host():
    facts = host_facts()
    if torch.cuda.is_available():
        assert facts.device_type == "cuda" and facts.gpu_count == torch.cuda.device_count()
    else:
        assert facts == HostFacts(device_type="cpu", gpu_count=0, fla_installed=False)
