"""Throughput of several LoRA runs on one base: stepping concurrently through the SDK vs one after another.

Run ``python benchmarks/lora_throughput.py [--runs 8] [--steps 3] [--rank 32] [--model smollm2-135m]``.

One server (``ringtune serve --model <model> --cp 2 --max-live-runs <runs + 1>``, a child on 127.0.0.1) gets
``--runs`` LoRA runs (``create_lora_training_client(base, rank=R)``, every target group, all on the one frozen
base). Each step of a run is one ``forward_backward`` (8 datums of 64 tokens) and one ``optim_step``.

1. **one after another**: run 1 does its ``--steps`` steps, then run 2, ... (one client thread);
2. **concurrently**: every run steps at once, one client thread each (a ``ServiceClient`` per thread).

Printed: wall seconds of each phase, steps per second, and the ratio concurrent / sequential throughput. The
backend executes one command at a time (the ranks take one command at a time, served round-robin across runs),
and ringtune does not batch the forward passes of several adapters into one pass (docs/lora.md, "Not built
yet"), so a ratio near 1 is expected: concurrency only overlaps the clients' HTTP and serialisation with the
compute. Each phase's losses are checked equal run by run (the same data, the same adapters' seeds): the order
in which runs are served does not change a run's numbers.
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


def train(tc: tinker.TrainingClient, data: list[tinker.Datum], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--cp", "2", "--max-live-runs", str(2 * args.runs + 1)]
        server = ServeProcess(
            args.model, checkpoint_root=Path(tmp) / "ckpt", log_path=Path(tmp) / "serve.log", extra_args=extra
        )
        with server:
            print(f"server: ringtune serve --model {args.model} --cp 2; {args.runs} LoRA runs of rank {args.rank}")
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
            errors: list[str] = []
            ready = threading.Barrier(args.runs + 1)

            def client(i: int) -> None:
                with tinker.ServiceClient(base_url=server.url, api_key=server.api_key) as own:
                    tc = own.create_lora_training_client(args.model, rank=args.rank, seed=i).result()
                    ready.wait()
                    try:
                        concurrent[i] = train(tc, data[i], args.steps)
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
    print(f"one after another: {sequential_s:.1f} s for {total} steps ({total / sequential_s:.3f} steps/s)")
    print(f"concurrently:      {concurrent_s:.1f} s for {total} steps ({total / concurrent_s:.3f} steps/s)")
    print(f"throughput concurrent / one after another: {sequential_s / concurrent_s:.2f}x (no multi-adapter batching)")
    same = not errors and all(a == b for a, b in zip(sequential, concurrent, strict=True))
    print(f"errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    print(f"losses of each run equal in both phases: {'PASS' if same else 'FAIL'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
