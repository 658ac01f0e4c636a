"""fla's context parallelism (``fla_cp``) vs ringtune's chunkwise hand-off, CP=2 on CPU under Triton's interpreter.

Run ``python benchmarks/gated_delta_fla_cp.py [--tokens 256 512]`` (needs the ``triton-cpu`` extra in
``.venv/triton-cpu``, which ``make test`` installs; the two gloo ranks put it on their path, this process never
imports Triton). One GDN core layer (conv, q/k norm, delta rule), float32, one sequence per row, forward + backward:

- bytes each rank sends, forward and backward, measured (``measure_comm``: fla's all-gathers are bound to ringtune's,
  ``ops/gated_delta/cp_fla.py``) and checked byte for byte against the shape model of ``gated_delta_cp.py``
  (``model_bytes``), then the model's table at the Qwen3.5-4B GDN shape for C = 2, 4, 8;
- seconds of forward + backward of ``chunkwise`` (ringtune's torch kernels), ``chunkwise`` with the ``fla`` scan
  (interpreted) and ``fla_cp`` (interpreted), after a warm-up. Under the interpreter a kernel's body runs in NumPy,
  once per program of its grid, so these seconds count kernel programs and Python overhead: they say nothing about
  a GPU, where the question (is fla's summary kernel + merge faster than ringtune's torch summary) is the H100's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gated_delta_cp import FLA_CP, MIB, QWEN35_4B, GDNShape, _random_inputs, model_all_ranks, pass_fail

from ringtune.layout.zigzag import zigzag_plan
from ringtune.ops.gated_delta.cp import gdn_cp_fn
from ringtune.parallel import measure_comm, spawn

KERNEL_SITE = Path(sys.prefix) / "triton-cpu"
SHAPE = GDNShape(hk=2, hv=4, dk=16, dv=32)
"""Interpretable shape (fla's ``tl.dot`` needs dims of 16 or more); Hk != Hv and Dk != Dv so each term shows."""
RUNS = ("chunkwise", "chunkwise + fla scan", FLA_CP)


def _layer(run: str, plan, group: dist.ProcessGroup, gen: torch.Generator) -> tuple[int, int, float]:
    """One forward + backward of ``run`` on fresh inputs: (bytes sent forward, backward, seconds)."""
    from ringtune.ops.gated_delta import chunked

    x = _random_inputs(plan, SHAPE, gen)
    mode = FLA_CP if run == FLA_CP else "chunkwise"
    default = chunked.default_chunk_scan
    if run == "chunkwise + fla scan":
        chunked.default_chunk_scan = lambda device: "fla"  # what a CUDA device with fla installed gets
    try:
        start = time.perf_counter()
        with measure_comm() as fwd:
            out = gdn_cp_fn(mode)(x["q"], x["k"], x["v"], x["g"], x["beta"], x["conv_weight"], plan, group)
        with measure_comm() as bwd:
            out.backward(x["dout"])
        seconds = time.perf_counter() - start
    finally:
        chunked.default_chunk_scan = default
    return fwd.bytes_sent, bwd.bytes_sent, seconds


def interpreted_worker(rank: int, tokens_list: list[int], repeats: int) -> dict:
    """On each of two ranks: per (tokens, run) the bytes sent and the seconds of ``repeats`` runs after a warm-up."""
    sys.path.insert(0, str(KERNEL_SITE))  # this process only: Triton, fla (see tests/test_triton_cpu.py for why)
    from support.triton_interpreter import fla_cp_on_cpu, interpreted_kernels, interpreter_session

    torch.set_num_threads(1)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    out = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(interpreter_session())
        interpreted_kernels("fla.ops.gated_delta_rule", "fla.modules.causal_conv1d", "fla.ops.cp")
        stack.enter_context(fla_cp_on_cpu())
        warm = zigzag_plan([128], cp_size=2, cp_rank=rank)
        for run in RUNS:
            _layer(run, warm, group, gen)
        for tokens in tokens_list:
            plan = zigzag_plan([tokens], cp_size=2, cp_rank=rank)
            for run in RUNS:
                results = [_layer(run, plan, group, gen) for _ in range(repeats)]
                out[tokens, run] = {"bytes": results[0][:2], "seconds": [r[2] for r in results]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512], help="one sequence per row; CP=2")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per configuration (median printed)")
    args = parser.parse_args(argv)
    if not (KERNEL_SITE / "triton").is_dir() or not (KERNEL_SITE / "fla").is_dir():
        print(f"{KERNEL_SITE} lacks triton / fla: run `make test` first (it installs the triton-cpu extra there)")
        return 2
    start = time.perf_counter()
    print(f"fla_cp vs chunkwise, CP=2, Triton's interpreter; {SHAPE.describe()}, float32, torch {torch.__version__}")
    measured = spawn(interpreted_worker, 2, args.tokens, args.repeats, threads=1)
    exact = all(
        measured[r][tokens, run]["bytes"]
        == model_all_ranks(FLA_CP if run == FLA_CP else "chunkwise", tokens, 2, SHAPE, torch.float32)[r]
        for tokens in args.tokens
        for run in RUNS
        for r in range(2)
    )
    print(f"  bytes sent == model (chunkwise, fla_cp), both ranks, both directions   goal exact   {pass_fail(exact)}")
    print(f"  {'tokens':>6} {'run':<22} {'fwd B max':>9} {'bwd B max':>9} {'s median':>8} {'/chunkwise':>10}")
    for tokens in args.tokens:
        base = statistics.median(
            max(measured[r][tokens, "chunkwise"]["seconds"][i] for r in range(2)) for i in range(args.repeats)
        )
        for run in RUNS:
            per = [max(measured[r][tokens, run]["seconds"][i] for r in range(2)) for i in range(args.repeats)]
            fwd = max(measured[r][tokens, run]["bytes"][0] for r in range(2))
            bwd = max(measured[r][tokens, run]["bytes"][1] for r in range(2))
            sec = statistics.median(per)
            print(f"  {tokens:>6} {run:<22} {fwd:>9} {bwd:>9} {sec:>8.2f} {sec / base:>10.1f}")
    print(f"  model at the Qwen3.5-4B GDN shape ({QWEN35_4B.describe()}), float32, one 65536-token sequence, MiB:")
    print(f"  {'C':>2} {'chunkwise fwd|bwd max':>22} {'fla_cp fwd|bwd max':>20} {'fla_cp / chunkwise':>18}")
    for cp in (2, 4, 8):
        chunk = model_all_ranks("chunkwise", 65536, cp, QWEN35_4B, torch.float32)
        fla = model_all_ranks(FLA_CP, 65536, cp, QWEN35_4B, torch.float32)
        c_max, f_max = max(f + b for f, b in chunk), max(f + b for f, b in fla)
        print(
            f"  {cp:>2} {max(f for f, _ in chunk) / MIB:>10.2f} | {max(b for _, b in chunk) / MIB:<9.2f} "
            f"{max(f for f, _ in fla) / MIB:>9.2f} | {max(b for _, b in fla) / MIB:<8.2f} {f_max / c_max:>18.4f}"
        )
    print(f"{int(exact)}/1 checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
