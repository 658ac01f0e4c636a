"""The GPU path on CPU: ``benchmarks/gpu_check.py --smoke`` end to end, and every GPU kernel refusing CPU tensors.

The smoke run is the whole GPU check at tiny sizes with each GPU kernel replaced by its CPU counterpart (labelled
"cpu fallback"): kernel parity against the float64 reference, a training step of ringtune and of transformers,
CP=2 against CP=1 over gloo. It keeps the script from rotting between GPU runs; the GPU figures are in docs/gpu.md.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringtune.models.head_kernels import select_head
from ringtune.ops.gated_delta import causal_conv1d
from ringtune.ops.gated_delta.chunked import chunk_scan_fn, default_chunk_scan
from ringtune.ops.gated_delta.conv import select_conv
from ringtune.ops.gated_delta.fla_kernels import FlaUnavailableError, fla_chunk_scan

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_runs_every_part_on_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parity = report["kernel_parity"]
    cases = {r["case"].split(" Hq=")[0].split(" Hk=")[0] for r in parity}
    assert {"attention causal", "attention split+lse merge", "attention full blocks", "GDN causal conv1d K=4"} <= cases
    assert any("with initial/final state" in c for c in cases) and any("log-prob head" in c for c in cases)
    assert all(r["pass"] for r in parity), parity
    assert all("cpu" in r["kernel"] for r in parity)  # fallbacks are labelled as such
    (step,) = report["training_step"]
    assert step["ringtune"]["status"] == step["transformers"]["status"] == "ok"
    assert step["ringtune"]["tokens_per_s"] > 0 and step["time_ratio"] > 0
    assert report["cp2"]["pass"] and report["cp2"]["backend"] == "gloo"
    (head,) = report["head_timing"]  # CPU: the tiled head only
    assert head["kernel"] == "tiled" and head["ms"] > 0 and head["ratio"] == 1.0
    assert "| kernel parity vs float64 CPU |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_kernels_are_chosen_by_device_and_refuse_cpu():
    cpu = torch.device("cpu")
    assert default_chunk_scan(cpu) == "recompute" and chunk_scan_fn(None, cpu).__name__ == "recomputing_chunk_scan"
    assert select_conv(cpu, with_context=False) == "torch"
    k = torch.zeros(4, 2, 8)
    with pytest.raises(FlaUnavailableError, match="needs CUDA tensors; got device cpu"):
        fla_chunk_scan(k, k, k, k[..., 0], k[..., 0], [0, 4], None)
    x, w = torch.zeros(4, 6), torch.zeros(6, 4)
    with pytest.raises(FlaUnavailableError, match="fla causal conv1d needs CUDA"):
        causal_conv1d(x, w, torch.tensor([0, 4]), kernel="fla")
    with pytest.raises(ValueError, match="takes no initial_context"):
        causal_conv1d(x, w, torch.tensor([0, 4]), kernel="fla", initial_context=torch.zeros(1, 3, 6))
    with pytest.raises(ValueError, match="conv kernel='cuda'"):
        select_conv(cpu, with_context=False, name="cuda")
    labels = torch.zeros(4, dtype=torch.int64)
    assert select_head(cpu, labels).__name__ == "label_logprobs"
    with pytest.raises(ValueError, match="head kernel 'liger' needs CUDA tensors; got device cpu"):
        select_head(cpu, labels, name="liger")


def test_mfu_peak_follows_the_device_name():
    spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "benchmarks" / "gpu_step.py")
    gpu_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_step)
    h200 = gpu_step.H200_BF16_TFLOPS
    assert gpu_step.peak_bf16_tflops("NVIDIA H200") == gpu_step.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == h200
    assert gpu_step.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.5
    assert gpu_step.peak_bf16_tflops("an unknown card") == h200
