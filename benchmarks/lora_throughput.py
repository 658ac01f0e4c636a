"""Throughput of several LoRA runs on one base: stepping concurrently through the SDK vs one after another,
with and without joining their forward passes (multi-adapter batching).

Run ``python benchmarks/lora_throughput.py [--runs 8] [--steps 3] [--rank 32] [--model smollm2-135m]
[--pass-runs 1 8]``.

For each ``--pass-runs`` value N, one server (``ringtune serve --model <model> --cp 2 --lora-pass-runs N``, a
child on 127.0.0.1) gets ``--runs`` LoRA runs (``create_lora_training_client(base, rank=R)``, every target
group, all on the one frozen base). Each step of a run is one ``forward_backward`` (8 datums of 64 tokens)
and one ``optim_step``.

1. **one after another**: run 1 does its ``--steps`` steps, then run 2, ... (one client thread);
2. **concurrently**: every run steps at once, one client thread each (a ``ServiceClient`` per thread).

Printed per server: wall seconds of each phase, steps per second, the ratio concurrent / sequential
throughput, and how many runs shared each concurrent forward_backward pass (``lora_pass_runs:max``, mean and
max). With N = 1 every request runs alone (the ranks take one command at a time), so concurrency only
overlaps the clients' HTTP and serialisation with the compute; with N > 1 the waiting forward_backward
requests of up to N runs run as one pass over the base. Each run's losses are compared between the phases:
with N = 1 they must be bit-equal (the order of service changes nothing), joined they must agree to 1e-5
relative (float32: a joined pass computes each token's rows in other matmul shapes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import tinker
from lora_runs import datums  # the same 8 datums of 64 tokens

from ringtune.gateway.serve_process import ServeProcess

ADAM = tinker.AdamParams(learning_rate=1e-4)


def train(
    tc: tinker.TrainingClient, data: list[tinker.Datum], steps: int, passes: list[float] | None = None
) -> list[float]:
    """``steps`` steps; each forward_backward's pass size is appended to ``passes`` (1 when it ran alone)."""
    losses = []
    for _ in range(steps):
        metrics = tc.forward_backward(data, "cross_entropy").result().metrics
        losses.append(metrics["loss:sum"])
        if passes is not None:
            passes.append(metrics.get("lora_pass_runs:max", 1.0))
        tc.optim_step(ADAM).result()
    return losses


def close(a: list[float], b: list[float], rel: float) -> bool:
    return all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def measure(args: argparse.Namespace, pass_runs: int) -> bool:
    """One server with ``--lora-pass-runs pass_runs``: both phases; prints the figures, returns the loss check."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--cp", "2", "--max-live-runs", str(2 * args.runs + 1), "--lora-pass-runs", str(pass_runs)]
        server = ServeProcess(
            args.model, checkpoint_root=Path(tmp) / "ckpt", log_path=Path(tmp) / "serve.log", extra_args=extra
        )
        with server:
            print(
                f"server: ringtune serve --model {args.model} --cp 2 --lora-pass-runs {pass_runs}; "
                f"{args.runs} LoRA runs of rank {args.rank}"
            )
            with tinker.ServiceClient(base_url=server.url, api_key=server.api_key) as sc:
                warm = sc.create_lora_training_client(args.model, rank=args.rank, seed=10_000).result()
                vocab = warm.get_tokenizer().vocab_size
                data = [datums(vocab, i) for i in range(args.runs)]
                train(warm, data[0], 1)  # warm-up: the first LoRA step pays one-off allocations (the shared base)
                make = lambda i: sc.create_lora_training_client(args.model, rank=args.rank, seed=i).result()  # noqa: E731
                sequential_clients = [make(i) for i in range(args.runs)]
                start = time.monotonic()
                sequential = [train(tc, data[i], args.steps) for i, tc in enumerate(sequential_clients)]
                sequential_s = time.monotonic() - start

            concurrent: list[list[float]] = [[] for _ in range(args.runs)]
            passes: list[float] = []
            errors: list[str] = []
            ready = threading.Barrier(args.runs + 1)

            def client(i: int) -> None:
                with tinker.ServiceClient(base_url=server.url, api_key=server.api_key) as own:
                    tc = own.create_lora_training_client(args.model, rank=args.rank, seed=i).result()
                    ready.wait()
                    try:
                        concurrent[i] = train(tc, data[i], args.steps, passes)
                    except Exception as exc:  # counted and printed, never hidden
                        errors.append(f"run {i}: {type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.runs)]
            for t in threads:
                t.start()
            ready.wait()
            start = time.monotonic()
            for t in threads:
                t.join()
            concurrent_s = time.monotonic() - start
    total = args.runs * args.steps
    print(f"  one after another: {sequential_s:.1f} s for {total} steps ({total / sequential_s:.3f} steps/s)")
    print(f"  concurrently:      {concurrent_s:.1f} s for {total} steps ({total / concurrent_s:.3f} steps/s)")
    print(f"  throughput concurrent / one after another: {sequential_s / concurrent_s:.2f}x")
    if passes:
        print(
            f"  runs per concurrent forward_backward pass: mean {sum(passes) / len(passes):.2f}, max {max(passes):.0f}"
        )
    print(f"  errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    if pass_runs == 1:
        same = not errors and all(a == b for a, b in zip(sequential, concurrent, strict=True))
        print(f"  losses of each run bit-equal in both phases: {'PASS' if same else 'FAIL'}")
    else:
        same = not errors and all(close(a, b, 1e-5) for a, b in zip(sequential, concurrent, strict=True))
        pairs = [(x, y) for a, b in zip(sequential, concurrent, strict=True) for x, y in zip(a, b, strict=False)]
        worst = max((abs(x - y) / abs(y) for x, y in pairs), default=float("nan"))
        print(
            f"  losses of each run within 1e-5 relative in both phases (max {worst:.1e}): {'PASS' if same else 'FAIL'}"
        )
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pass-runs", type=int, nargs="+", default=[1, 8], help="--lora-pass-runs of each server")
    args = parser.parse_args()
    ok = [measure(args, n) for n in args.pass_runs]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
