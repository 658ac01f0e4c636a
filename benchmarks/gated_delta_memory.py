"""What one GatedDeltaNet layer keeps for its backward, and its peak and time, per chunked scan.

Run ``python benchmarks/gated_delta_memory.py [--tokens 8192 16384] [--rounds 3] [--quick]``. Compares the two
scans of ``ringtune.ops.gated_delta.chunked.CHUNK_SCANS``: ``autograd`` (autograd keeps every intermediate of
the scan, the path before issue 12) and ``recompute`` (the default: the scan keeps its inputs and segment
start states and recomputes segment by segment in its backward). Every figure is measured inside this one
run; each check prints the value, the goal and PASS/FAIL.

Two subjects, on one sequence, 1 thread: **layer** = the first GDN layer of ``long_rows.py``'s benchmark model
(hidden 256, GDN 2 k / 4 v heads of 64, float32) run as ``GatedDeltaNet.forward`` at CP=1 (projections, gates,
``gated_delta_core`` with the scan by name, gated norm, ``out_proj``); **scan** = the chunked scan alone on
prepared inputs of that layer's shape (q, k, v [T, 4, 64], g, beta [T, 4]: what the scan changes).

1. saved activations: bytes of the distinct tensor storages autograd keeps between forward and backward
   (``torch.autograd.graph.saved_tensors_hooks``; parameters not counted), per token and over the layer
   input's 1 KiB per token. Goal for the scan: recompute / autograd <= 0.25 (it keeps its inputs); the
   layer's ratio is information (its conv, norms and projections keep ~13 KiB per token either way);
2. peak live tensor bytes of forward+backward (torch.profiler memory events), inputs and output gradient
   included, over the live bytes before it. Goal for the scan: recompute / autograd <= 0.5; the layer: information;
3. forward+backward time per token of the layer, interleaved rounds, median; goal recompute / autograd <= 1.5
   (the backward reruns the scan's forward once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from attention_cp import MIB, _quiet_stderr, verdict
from long_rows import MODEL, build_model, describe_model

from ringtune.models.layers.gated_deltanet import GatedDeltaNet
from ringtune.ops.gated_delta.chunked import chunk_scan_fn
from ringtune.ops.gated_delta.core import gated_delta_core

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import allocation_events

SCANS = ("autograd", "recompute")
SAVED_GOAL, PEAK_GOAL, TIME_GOAL = 0.25, 0.5, 1.5
Run = Callable[[], tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]
"""Builds fresh leaves, runs the forward: (leaves, output, output gradient)."""


def layer_run(layer: GatedDeltaNet, scan: str, tokens: int) -> Run:
    """``layer.forward`` at CP=1 on one sequence (no cache) with the chunked scan ``scan``: x [T, hidden] -> same."""

    def run() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        layer.zero_grad(set_to_none=True)  # every run allocates its parameter gradients afresh
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, MODEL["hidden_size"], generator=gen).requires_grad_()
        dout = torch.randn(tokens, MODEL["hidden_size"], generator=gen)
        q, k, v, g, beta, conv_weight = layer._project(x)
        cu = torch.tensor([0, tokens], dtype=torch.int64)
        o = gated_delta_core(q, k, v, cu, g=g, beta=beta, conv_weight=conv_weight, scan=scan)
        return [x], layer._output(x, o), dout

    return run


def scan_run(scan: str, tokens: int) -> Run:
    """The chunked scan ``scan`` alone on prepared inputs of the layer's shape (4 value heads of 64)."""
    heads, dim = MODEL["linear_num_value_heads"], MODEL["linear_key_head_dim"]

    def run() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(tokens)
        q = torch.randn(tokens, heads, dim, generator=gen) * dim**-0.5
        k = torch.nn.functional.normalize(torch.randn(tokens, heads, dim, generator=gen), dim=-1)
        v = torch.randn(tokens, heads, dim, generator=gen)
        g = -0.1 * torch.rand(tokens, heads, generator=gen)
        beta = torch.rand(tokens, heads, generator=gen)
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
        o, _ = chunk_scan_fn(scan)(*leaves, [0, tokens], None, output_final_state=False)
        return leaves, o, torch.randn(o.shape, generator=gen)

    return run


def saved_bytes(run: Run, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves in one forward (storages in ``exclude`` not counted)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def peak_bytes(run: Run) -> int:
    """Peak live tensor bytes of one forward+backward, inputs included, over the live bytes before it.

    The profiler's running total carries over from earlier profiles (blocks freed while it is off are never
    subtracted), so the peak is taken relative to the total just before this profile's first allocation.
    """
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    _, out, dout = run()
    out.backward(dout)
    with _quiet_stderr():
        prof.stop()
    events = allocation_events(prof)
    return max(total for _, _, total in events) - (events[0][2] - events[0][1])


def seconds(run: Run) -> float:
    start = time.perf_counter()
    _, out, dout = run()
    out.backward(dout)
    return time.perf_counter() - start


def row(tokens: int, label: str, values: dict[str, float], unit: Callable[[float], str], goal: float | None) -> bool:
    """Print one row (both scans, recompute / autograd, the goal if any); True unless a goal is missed."""
    ratio = values["recompute"] / values["autograd"]
    cells = "  ".join(f"{scan} {unit(values[scan])}" for scan in SCANS)
    check = f"(goal <= {goal})  {verdict(ratio, goal)}" if goal is not None else "(information)"
    print(f"    {tokens:>6} {label:<5}  {cells}  recompute/autograd {ratio:.3f} {check}")
    return goal is None or ratio <= goal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--quick", action="store_true", help="smoke run: 2K and 4K tokens, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = [2048, 4096], 1
    torch.set_num_threads(1)
    start = time.perf_counter()
    layer = build_model().model.layers[0].linear_attn
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    row_bytes = MODEL["hidden_size"] * 4  # the layer input per token, float32
    print(f"ringtune GDN layer memory per chunked scan: torch {torch.__version__}, 1 thread")
    print(f"model: {describe_model()}; layer input {row_bytes} B per token")
    runs = {
        (subject, scan, tokens): layer_run(layer, scan, tokens) if subject == "layer" else scan_run(scan, tokens)
        for subject in ("layer", "scan")
        for scan in SCANS
        for tokens in args.tokens
    }
    ok = []

    def per_token(tokens: int) -> Callable[[float], str]:
        return lambda x: f"{x / tokens:7.0f} B/token ({x / tokens / row_bytes:5.2f}x input)"

    def mib(tokens: int) -> Callable[[float], str]:
        return lambda x: f"{x / MIB:6.1f} MiB ({x / tokens / 1024:4.1f} KiB/token)"

    print("\n[1] saved activations of one forward (saved_tensors_hooks, distinct storages, no parameters)")
    for tokens in args.tokens:
        for subject, goal in (("layer", None), ("scan", SAVED_GOAL)):
            saved = {scan: saved_bytes(runs[subject, scan, tokens], params) for scan in SCANS}
            ok.append(row(tokens, subject, saved, per_token(tokens), goal))

    print("\n[2] peak live tensor bytes of one forward+backward (torch.profiler)")
    for tokens in args.tokens:
        for subject, goal in (("layer", None), ("scan", PEAK_GOAL)):
            peak = {scan: peak_bytes(runs[subject, scan, tokens]) for scan in SCANS}
            ok.append(row(tokens, subject, peak, mib(tokens), goal))

    print(f"\n[3] layer forward+backward time per token, {args.rounds} interleaved rounds, median, after a warm-up")
    for scan in SCANS:
        seconds(runs["layer", scan, min(args.tokens)])
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for tokens in args.tokens:
            for scan in SCANS:
                times.setdefault((scan, tokens), []).append(seconds(runs["layer", scan, tokens]))
    for tokens in args.tokens:
        per = {scan: statistics.median(times[scan, tokens]) / tokens for scan in SCANS}
        ok.append(row(tokens, "layer", per, lambda x: f"{x * 1e6:6.1f} us/token", TIME_GOAL))

    print(f"\n{sum(ok)}/{len(ok)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
