"""The GPU path on CPU: ``benchmarks/gpu_check.py --smoke`` end to end, and every GPU kernel refusing CPU tensors.

The smoke run is the whole GPU check at tiny sizes with each GPU kernel replaced by its CPU counterpart (labelled
"cpu fallback"): ``ringtune serve`` at CP=1 and CP=2 driven by the tinker SDK (first), kernel parity against the
float64 reference, CP=2 against CP=1 over gloo, the head, a training step of ringtune and of transformers. It
keeps the script from rotting between GPU runs; the GPU figures are in docs/gpu.md.
"""

from __future__ import annotations

import importlib.util
import json
import re
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
    check_service_lines(done.stdout, report["service"])
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
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| kernel parity vs float64 CPU |" in table and "| ringtune serve via the SDK |" in table
    assert "FAIL" not in table and "| CP=2 bf16-mixed save / load |" in table


NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?"


def check_service_lines(stdout: str, service: dict) -> None:
    """The service part's printed lines: for CP=1 and CP=2, each SDK step with its time, loss, gradient norm (the
    step clips to 1) and the server's peak memory (peak RSS on CPU), the sample, compute_logprobs against forward,
    KL by depth, save and load; ran first."""
    lines = stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("service"))
    assert first < next(i for i, ln in enumerate(lines) if ln.startswith("kernel parity:"))  # the service runs first
    assert service["pass"] and [r["cp"] for r in service["runs"]] == [1, 2]
    for cp in (1, 2):
        head = rf"service cp={cp} bf16-mixed"
        wanted = [
            rf"{head}: started in {NUMBER} s, {NUMBER} s in all",
            *(
                rf"{head} step {i}: {NUMBER} s, loss:sum {NUMBER}, grad_norm {NUMBER} \(clipped to 1\), "
                rf"peak {NUMBER} GiB"
                for i in (1, 2)
            ),
            rf"{head} sample: 4 tokens in {NUMBER} s",
            rf"{head} compute_logprobs: {NUMBER} s, max \|sampler - forward\| {NUMBER}",
            *(rf"{head} KL depth {d}: v1 {NUMBER} ± {NUMBER}, v2 {NUMBER}, max \|d\| {NUMBER}" for d in (16, 48)),
            rf"{head} save {NUMBER} s, load {NUMBER} s, \|loss after load - before\| 0\.0e\+00",
        ]
        for pattern in wanted:
            assert any(re.fullmatch(pattern, ln) for ln in lines), (pattern, lines[first : first + 20])
    for run in service["runs"]:
        steps = run["steps"]
        assert all(s["s"] > 0 and s["peak_gib"] > 0 and s["gpu_used_gib"] is None for s in steps)
        assert steps[0]["grad_norm"] > 1.0  # the first step's update was clipped (the clipping path ran)
        assert steps[1]["loss_sum"] < steps[0]["loss_sum"]  # the optim_step moved the weights
        # bf16-mixed: sampler and trainer share the weights; at CP=2 the decode path rounds differently (< 2e-3)
        assert run["compute_logprobs"]["max_abs_vs_forward"] < 2e-3
        assert all(abs(k["kl_sample_train_v1"]) < 1e-3 for k in run["kl_by_depth"].values())


def test_service_part_fails_loudly_when_the_model_is_off_the_gpu():
    """On CUDA the part fails unless the server's processes put at least the model's weights on the GPU; where
    nvidia-smi cannot say (this CPU machine), that is a failure too. A failed server prints one FAIL line."""
    gpu_service = _load("gpu_service")
    watch = gpu_service.GpuWatch(True, 2**30)
    with pytest.raises(RuntimeError, match=r"less than its ranks' 1\.00 GiB of float32 weights: the model is not on"):
        watch.check_placed("create_lora_training_client(rank=0) on --cp 1")
    gpu_service.GpuWatch(False, 2**30).check_placed("anything")  # CPU: nothing to check
    failed = {"runs": [{"cp": 2, "dtype": "bf16-mixed", "pass": False, "error": "RankFailedError: nccl"}]}
    assert gpu_service.service_lines(failed) == ["service cp=2 bf16-mixed: FAIL RankFailedError: nccl"]
    timed_out = failed | {"error": "timeout after 200 s: no output"}
    assert gpu_service.service_lines(timed_out)[-1] == "service: FAIL timeout after 200 s: no output"


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


def _load(name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks is not a package), its folder on ``sys.path`` as when it
    runs as a script (it imports the benchmarks beside it)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mfu_peak_follows_the_device_name():
    gpu_step = _load("gpu_step")
    h200 = gpu_step.H200_BF16_TFLOPS
    assert gpu_step.peak_bf16_tflops("NVIDIA H200") == gpu_step.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == h200
    assert gpu_step.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.5
    assert gpu_step.peak_bf16_tflops("an unknown card") == h200
