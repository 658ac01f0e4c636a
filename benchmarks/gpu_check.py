"""The GPU check: the service driven by the SDK, kernel parity, CP=2 on one GPU, the head, a 4B-shaped step.

`python benchmarks/gpu_check.py --out DIR [--tokens 8192 32768 65536] [--budget-s 360]` on one CUDA GPU (built to
fit 8 minutes on one H100), or `--smoke` on CPU at tiny sizes (the test suite runs it: tests/test_gpu_check.py).
Writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (the tables docs/gpu.md takes) and prints the markdown.
The parts, in the order they run:

1. **The service** (``gpu_service.py``, first; on a GPU in its own process under ``--service-timeout-s``):
   ``ringtune serve`` on a Qwen3.5-shaped model (random weights, ``save_pretrained``) at CP=1, then CP=2 on the
   same device, driven by the unmodified tinker SDK: forward_backward + optim_step steps (time, the server's peak
   memory), a sample, ``compute_logprobs``, KL(sampler ‖ trainer) by depth, a save and a load. On CUDA a server that
   leaves the model off the GPU fails the part.
2. **Kernel parity** (``gpu_parity.py``): every GPU kernel of the registries against the float64 CPU reference,
   forward and backward, with its dtype's limit; on CPU each is replaced by its CPU counterpart, labelled so.
3. **CP=2 on one device** (``gpu_cp2.py``): two processes against CP=1, within the bf16 parity limits, with the
   default modes and again with ``--linear-cp-mode fla_cp`` (fla's own context parallelism).
4. **Head kernels timed** (``gpu_head.py``): ``tiled`` against Liger's fused linear cross-entropy at the 4B head's
   size, forward + backward time and peak memory (the head's default changes only if ``liger`` is faster at equal
   memory).
5. **Training step** (``gpu_step.py``, one fresh process per configuration so each peak is its own): forward,
   backward and AdamW of the Qwen3.5-4B shape (random weights, real sizes, bf16-mixed, selective recompute) on one
   row of N tokens at CP=1, by ringtune and by transformers (+ fla when installed): tokens/s, MFU, peak memory,
   and ringtune / transformers step-time and peak-memory ratios (issue 19 goals: ≤ 0.8 and ≤ 0.5). Each row takes
   the most of the 4B's 32 layers whose planned peak fits the device (:func:`step_layers`: all on an H200, 24 / 20
   / 12 at 8K / 32K / 64K on an H100). A configuration that would start after ``--budget-s`` is skipped and says so.

Exit status 0 when the service part, every kernel-parity row and the CP=2 check pass (the step figures are
reported, not gated).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_cp2 import cp2_parity
from gpu_head import head_timing
from gpu_parity import kernel_parity
from gpu_service import service_check, service_lines
from gpu_step import H200_BF16_TFLOPS, SMOKE_MODEL, peak_bf16_tflops, run_step

from ringtune.layout.budget import rank_token_budget
from ringtune.models.config import DecoderConfig
from ringtune.plan.estimate import Layout, estimate
from ringtune.plan.models import KNOWN_MODELS
from ringtune.plan.search import PAD_MULTIPLIER

HERE = Path(__file__).resolve().parent
TIME_GOAL, MEMORY_GOAL = 0.8, 0.5
FULL_LAYERS = KNOWN_MODELS["Qwen3.5-4B"]["num_hidden_layers"]
STEP_MEMORY_FRACTION = 0.9
"""The share of the device's memory a step row's planned peak may take (the planner is within ~3 % on CPU)."""


def versions() -> dict[str, object]:
    """Versions of what the check depends on (None: not installed)."""
    out: dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("ringtune", "triton", "flash-linear-attention", "fla-core", "liger-kernel", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out["peak_bf16_tflops"] = peak_bf16_tflops(out["device"])  # "cpu" (smoke): the H200's figure
    try:
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        out["commit"] = None
    return out


def step_subprocess(impl: str, tokens: int, layers: int, timeout_s: float) -> dict:
    """``gpu_step.py`` in a fresh process (its own CUDA context and memory peak); its JSON line or the failure."""
    cmd = [sys.executable, str(HERE / "gpu_step.py"), "--impl", impl, "--tokens", str(tokens), "--model", "4b"]
    cmd += ["--layers", str(layers)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "tokens": tokens, "status": f"timeout after {timeout_s:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"impl": impl, "tokens": tokens, "status": f"failed (exit {done.returncode}): {tail[0][:300]}"}
    return json.loads(lines[-1])


def service_subprocess(out: Path, timeout_s: float) -> dict:
    """``gpu_service.py --device cuda`` in a fresh process under ``timeout_s`` (a hung SDK call or server cannot eat
    the run); its report (``gpu_service.json``, rewritten after each server) or why there is none."""
    cmd = [sys.executable, str(HERE / "gpu_service.py"), "--device", "cuda", "--out", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        failure = None if done.returncode == 0 else f"exit {done.returncode}"
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        failure, tail = f"timeout after {timeout_s:.0f} s", []
    path = out / "gpu_service.json"
    report = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    if failure is not None:
        report["pass"] = False
        if failure.startswith("timeout") or not report.get("runs"):  # else the failed runs say why
            report.setdefault("error", f"{failure}: {(tail or ['no output'])[0][:300]}")
    return report


def cp2_subprocess(timeout_s: float) -> dict:
    """``gpu_cp2.py --device cuda`` in a fresh process under ``timeout_s``; its JSON or why there is none."""
    cmd = [sys.executable, str(HERE / "gpu_cp2.py"), "--device", "cuda"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:  # keep what the backends tried before the hang reported
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"backend": None, "pass": False, "failed_backends": []}
        result["failed_backends"] = [*result.get("failed_backends", []), f"timeout after {timeout_s:.0f} s"]
        return result
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"backend": "nccl", "pass": False, "failed_backends": [f"exit {done.returncode}: {tail[0][:300]}"]}
    return json.loads(lines[-1])


def planned_peak_gib(tokens: int, layers: int = FULL_LAYERS) -> float:
    """``ringtune plan``'s predicted peak of this step (Qwen3.5-4B, its first ``layers`` layers, CP=1, replicated,
    selective recompute, bf16-mixed, fused AdamW), GiB: set beside the measured peak, the planner's first check on
    a GPU."""
    layout = Layout(cp=1, dp=1, shard="none", recompute="selective", precision="bf16-mixed")
    local = rank_token_budget(tokens, 1, pad_multiplier=PAD_MULTIPLIER)
    hf = {**KNOWN_MODELS["Qwen3.5-4B"], "num_hidden_layers": layers}
    return estimate(DecoderConfig.from_hf(hf), layout, local).peak / 2**30


def step_layers(tokens: int, device_gib: float) -> int:
    """The most layers of the 4B (a multiple of its attention interval, all 32 when they fit) whose planned peak
    at ``tokens`` stays within :data:`STEP_MEMORY_FRACTION` of the device's memory: the full shape on an H200, a
    shallower one on an H100 (whose 80 GB the full 4B step at 8K, 85.4 GiB planned, does not fit)."""
    interval = KNOWN_MODELS["Qwen3.5-4B"]["full_attention_interval"]
    for layers in range(FULL_LAYERS, interval - 1, -interval):
        if planned_peak_gib(tokens, layers) <= STEP_MEMORY_FRACTION * device_gib:
            return layers
    return interval


def training_steps(args: argparse.Namespace, started: float, save, rows: list[dict]) -> None:
    """Per token count: ringtune's and transformers' step (in-process at smoke size on CPU), appended to ``rows``;
    ``save()`` after each."""
    device_gib = 0.0 if args.smoke else torch.cuda.get_device_properties(0).total_memory / 2**30
    for tokens in args.tokens:
        pair = {}
        layers = None if args.smoke else step_layers(tokens, device_gib)  # smoke: the tiny model, not the 4B
        for impl in ("ringtune", "transformers"):
            if args.smoke:
                pair[impl] = run_step(impl, "smoke", tokens, 2, torch.device("cpu"), H200_BF16_TFLOPS)
            elif time.time() - started > args.budget_s:
                pair[impl] = {"impl": impl, "tokens": tokens, "status": f"skipped: past --budget-s {args.budget_s}"}
            else:
                pair[impl] = step_subprocess(impl, tokens, layers, args.step_timeout_s)
        ours, theirs = pair["ringtune"], pair["transformers"]
        both = ours.get("status") == "ok" and theirs.get("status") == "ok"
        row = {"tokens": tokens, "layers": layers, "ringtune": ours, "transformers": theirs}
        row["planned_gib"] = planned_peak_gib(tokens, layers or FULL_LAYERS)
        if both:
            row["time_ratio"] = ours["step_s"] / theirs["step_s"]
            if ours.get("peak_mem_gib") and theirs.get("peak_mem_gib"):
                row["memory_ratio"] = ours["peak_mem_gib"] / theirs["peak_mem_gib"]
        rows.append(row)
        save()


def service_markdown(service: dict) -> list[str]:
    """The service part as a table: per server (CP) its steps, sample, compute_logprobs, KL by depth, save/load."""
    lines = ["| ringtune serve via the SDK | figure | pass |", "|---|---|---|"]
    if "error" in service and not service.get("runs"):
        return [*lines, f"| — | {service['error']} | FAIL |"]
    for r in service.get("runs", []):
        where = f"CP={r['cp']} {r['dtype']}"
        if not r["pass"]:
            lines.append(f"| {where} | {r.get('error')} | FAIL |")
            continue
        for s in r["steps"]:
            used = "" if s["gpu_used_gib"] is None else f", GPU in use {s['gpu_used_gib']:.2f} GiB"
            lines.append(f"| {where} step {s['step']} | {s['s']:.2f} s, peak {s['peak_gib']:.2f} GiB{used} | PASS |")
        c = r["compute_logprobs"]
        lines.append(f"| {where} sample | {r['sample']['tokens']} tokens in {r['sample']['s']:.2f} s | PASS |")
        lines.append(f"| {where} compute_logprobs | max \\|Δ\\| vs forward {c['max_abs_vs_forward']:.1e} | PASS |")
        for depth, k in r["kl_by_depth"].items():
            lines.append(
                f"| {where} KL(sampler ‖ trainer) depth {depth} | v1 {k['kl_sample_train_v1']:.2e} ± {k['se_v1']:.1e}, "
                f"v2 {k['kl_sample_train_v2']:.2e} | PASS |"
            )
        lines.append(f"| {where} save / load | {r['save_s']:.2f} s / {r['load_s']:.2f} s | PASS |")
    if "error" in service:
        lines.append(f"| — | {service['error']} | FAIL |")
    return lines


def _fmt(x: object, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, float) else ("—" if x is None else str(x))


def markdown(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"GPU check ({'smoke, CPU fallbacks' if report['smoke'] else 'full'}): {report['date']}, {v['device']}, "
        f"torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, fla {v['flash-linear-attention']}, "
        f"liger {v['liger-kernel']}, transformers {v['transformers']}, ringtune {v['commit']}; "
        f"{report['elapsed_s']:.0f} s; MFU against {v['peak_bf16_tflops']} TFLOP/s dense bf16",
        "",
        "| kernel parity vs float64 CPU | kernel | dtype | forward | limit | backward | limit | pass |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in report["kernel_parity"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['kernel']} | — | error: {r['error']} | | | | FAIL |")
            continue
        lines.append(
            f"| {r['case']} | {r['kernel']} | {r['dtype']} | {r['forward']:.1e} | {r['limit_forward']:.0e} | "
            f"{r['backward']:.1e} | {r['limit_backward']:.0e} | {'PASS' if r['pass'] else 'FAIL'} |"
        )
    lines += ["", *service_markdown(report.get("service") or {})]
    lines += [
        "",
        "| tokens | 4B layers | ringtune tok/s | MFU | peak GiB | planned GiB | transformers tok/s | MFU | peak GiB "
        "| time ratio (≤ 0.8) | memory ratio (≤ 0.5) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["training_step"]:
        o, t = r["ringtune"], r["transformers"]

        def cell(d, key, spec=".3g"):
            return _fmt(d.get(key), spec) if d.get("status") == "ok" else d.get("status", "—")

        lines.append(
            f"| {r['tokens']} | {_fmt(r.get('layers'))}/{FULL_LAYERS} | {cell(o, 'tokens_per_s', '.0f')} | "
            f"{cell(o, 'mfu', '.3f')} | "
            f"{_fmt(o.get('peak_mem_gib'), '.1f')} | {_fmt(r.get('planned_gib'), '.1f')} | "
            f"{cell(t, 'tokens_per_s', '.0f')} | {cell(t, 'mfu', '.3f')} | "
            f"{_fmt(t.get('peak_mem_gib'), '.1f')} | {_fmt(r.get('time_ratio'), '.2f')} | "
            f"{_fmt(r.get('memory_ratio'), '.2f')} |"
        )
    lines += ["", "| head kernel (fwd + bwd) | tokens | V x D | ms | / tiled | peak above inputs GiB |"]
    lines.append("|---|---:|---|---:|---:|---:|")
    for h in report.get("head_timing", []):
        if "error" in h:
            lines.append(f"| {h['kernel']} | {h['tokens']} | {h['vocab']} x {h['dim']} | {h['error']} | | |")
            continue
        lines.append(
            f"| {h['kernel']} | {h['tokens']} | {h['vocab']} x {h['dim']} | {h['ms']:.1f} | "
            f"{_fmt(h.get('ratio'), '.2f')} | {_fmt(h.get('extra_gib'), '.2f')} |"
        )
    c = report["cp2"]
    lines += ["", "| CP=2 vs CP=1 on one device | value | limit | pass |", "|---|---:|---:|---|"]
    for key, value in (c.get("figures") or {}).items():
        lines.append(f"| {key} ({c['backend']}) | {value:.2e} | {c['limits'][key]:.0e} | {value <= c['limits'][key]} |")
    if c.get("failed_backends"):
        lines.append(f"| backends that failed | {'; '.join(c['failed_backends'])} | | |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, GPU kernels replaced by CPU ones")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--budget-s", type=float, default=360.0, help="start no training-step run after this many s")
    p.add_argument("--step-timeout-s", type=float, default=100.0)
    p.add_argument("--cp2-timeout-s", type=float, default=160.0)
    p.add_argument("--service-timeout-s", type=float, default=200.0)
    args = p.parse_args()
    if args.smoke:
        args.tokens = [96]
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run with --smoke on CPU")
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    started = time.time()
    report: dict = {"smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report["versions"] = versions()
    report["kernel_parity"], report["cp2"], report["training_step"] = [], {"pass": False}, []
    report["head_timing"], report["service"] = [], {"pass": False, "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> str:  # after every part: a run stopped by its time limit still leaves what it measured
        report["elapsed_s"] = time.time() - started
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        text = markdown(report)
        (args.out / "gpu_check.md").write_text(text)
        return text

    if args.smoke:
        report["service"] = service_check(False, True)
    else:
        report["service"] = service_subprocess(args.out, args.service_timeout_s)
    save()
    print("\n".join(service_lines(report["service"])), flush=True)
    print(f"service: {time.time() - started:.0f} s", flush=True)
    report["kernel_parity"] = kernel_parity(device, smoke=args.smoke)
    save()
    print(f"kernel parity: {time.time() - started:.0f} s", flush=True)
    report["cp2"] = cp2_parity(SMOKE_MODEL, device) if args.smoke else cp2_subprocess(args.cp2_timeout_s)
    save()
    print(f"CP=2: {time.time() - started:.0f} s", flush=True)
    report["head_timing"] = head_timing(device, smoke=args.smoke)
    save()
    print(f"head timing: {time.time() - started:.0f} s", flush=True)
    training_steps(args, started, save, report["training_step"])
    print(save(), flush=True)
    ok = all(r["pass"] for r in report["kernel_parity"]) and report["cp2"]["pass"] and report["service"]["pass"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
