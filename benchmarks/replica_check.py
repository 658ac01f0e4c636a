"""The replica check's cost per optim_step (:mod:`ringtune.engine.replica_check`) at SmolLM2-135M size.

Run ``python benchmarks/replica_check.py [--repeats 5] [--dtype float32]``. Two gloo ranks (DP=2, replicated) each
load the embedded SmolLM2-135M, take one AdamW step on identical seeded gradients (so both moments exist), then
time, in the same run: the checksums alone (one read of every parameter and both AdamW moments), the whole
check (checksums + the exchange over the control group + the comparison), and one AdamW step
(``torch.optim.AdamW.step`` on the same tensors) as the yardstick. Prints the median milliseconds of each and
the check's ratio to the AdamW step, per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from ringtune.engine.replica_check import ReplicaCheck, checksums
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT, load_model

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.harness import RankPool


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(ctx, *, repeats: int, dtype: str) -> dict[str, float]:
    """On every rank: the medians (ms) of the checksums, the whole check and one AdamW step."""
    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=2, cp=1)
    model = load_model(EMBEDDED_DEFAULT, dtype=getattr(torch, dtype))
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 1e-3
    optimizer.step()
    check = ReplicaCheck(mesh, "none")
    named = check.named_tensors(params, names, optimizer)
    numel = sum(t.numel() for _, t in named)
    out = {
        "tensors": float(len(named)),
        "elements_millions": numel / 1e6,
        "checksums_ms": _median_ms(lambda: checksums([t for _, t in named]), repeats),
        "check_ms": _median_ms(lambda: check.verify(params, names, optimizer, 1, mesh.control_group), repeats),
        "adamw_step_ms": _median_ms(optimizer.step, repeats),
    }
    out["check_over_adamw"] = out["check_ms"] / out["adamw_step_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    import replica_check as bench  # this file by its module name: the ranks look the case up by module and name

    pool = RankPool(2, timeout=1200)
    try:
        results = pool.run(bench.measure, repeats=args.repeats, dtype=args.dtype)
    finally:
        pool.close()
    print(f"replica check at SmolLM2-135M size ({args.dtype}, 2 gloo ranks, 1 thread each, median of {args.repeats})")
    for rank, r in enumerate(results):
        print(
            f"  rank {rank}: {r['tensors']:.0f} tensors, {r['elements_millions']:.1f}M elements: checksums "
            f"{r['checksums_ms']:.1f} ms, whole check {r['check_ms']:.1f} ms, AdamW step {r['adamw_step_ms']:.1f} "
            f"ms, check / AdamW step {r['check_over_adamw']:.3f}"
        )


if __name__ == "__main__":
    main()
