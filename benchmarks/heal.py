"""Self-healing figures of ``ringtune serve`` on this machine: a worker rank SIGKILLed under load.

Starts ``ringtune serve --cp 2 --autosave-every 2`` (SmolLM2-135M by default, embedded, no download), trains two
runs through the SDK (run A 3 optimizer steps, so its newest autosave is 1 step behind; run B 2 steps, autosaved
at its current step), then sends a forward_backward of A (running when the kill lands) and one of B (queued
behind it), SIGKILLs the worker rank and prints:

- seconds from the SIGKILL to the failure of the request in flight, and to ``/api/v1/healthz`` answering 200;
- what each request got: A's (in flight) a server error; B's (queued) runs after the heal (B lost nothing);
- per run, the step it was at and the step it was restored to (steps lost), from the one-time notice.

    .venv/bin/python benchmarks/heal.py [--model smollm2-135m] [--cp 2] [--length 256] [--vocab 1000]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx
import tinker
import torch

from ringtune.gateway.serve_process import ServeProcess, worker_pids

ADAM = tinker.AdamParams(learning_rate=1e-4)


VOCAB = [1000]
"""Token ids are drawn below this (``--vocab``)."""


def datums(seed: int, n: int, length: int) -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(1, VOCAB[0], (length + 1,), generator=gen).tolist()
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--length", type=int, default=256, help="tokens per datum")
    parser.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    args = parser.parse_args()
    VOCAB[0] = args.vocab
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--cp", str(args.cp), "--autosave-every", "2", "--autosave-keep", "1", "--max-restarts", "1"]
        extra += ["--context-length", str(2 * args.length), "--log-level", "info"]
        server = ServeProcess(
            args.model, checkpoint_root=Path(tmp) / "ckpt", log_path=Path(tmp) / "serve.log", extra_args=extra
        )
        with server:
            sc = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
            runs = {name: sc.create_lora_training_client(args.model, rank=0) for name in ("A", "B")}
            runs = {name: future.result() for name, future in runs.items()}
            steps = {"A": 3, "B": 2}
            for name, tc in runs.items():
                for step in range(steps[name]):
                    tc.forward_backward(datums(step, 4, args.length), "cross_entropy").result()
                    tc.optim_step(ADAM).result()
            # A's request is dispatched first and runs on the ranks when the kill lands; B's waits behind it.
            running = runs["A"].forward_backward(datums(100, 32, args.length), "cross_entropy")
            time.sleep(2.0)
            queued = runs["B"].forward_backward(datums(101, 4, args.length), "cross_entropy")
            time.sleep(0.5)
            (worker,) = worker_pids(server.proc.pid)[:1]
            killed = time.monotonic()
            os.kill(worker, 9)
            outcomes: dict[str, tuple[float, str]] = {}

            def wait(name: str, future) -> None:
                try:
                    future.result(timeout=1800)
                    outcomes[name] = (time.monotonic(), "completed")
                except tinker.RequestFailedError as exc:
                    outcomes[name] = (time.monotonic(), f"failed ({exc.category.value}): {exc}")

            waiters = [threading.Thread(target=wait, args=item) for item in (("A", running), ("B", queued))]
            for t in waiters:
                t.start()
            while httpx.get(f"{server.url}/api/v1/healthz", timeout=5).status_code != 200:
                time.sleep(0.1)
            healthy = time.monotonic()
            for t in waiters:
                t.join()
            restored = {}
            for name, tc in runs.items():
                told = re.search(r"restored to step (\d+)", outcomes[name][1])
                if told is None:
                    try:
                        tc.forward(datums(7, 1, 16), "cross_entropy").result()
                    except tinker.RequestFailedError as exc:
                        told = re.search(r"restored to step (\d+)", str(exc))
                restored[name] = int(told.group(1)) if told else steps[name]
            print(f"ringtune serve --model {args.model} --cp {args.cp} --autosave-every 2, worker SIGKILLed:")
            print(f"  healthz 200 again {healthy - killed:.1f} s after the SIGKILL")
            for name, label in (("A", "in flight"), ("B", "queued behind it")):
                when, what = outcomes[name]
                print(f"  request of run {name} ({label}), {when - killed:.1f} s after the SIGKILL: {what[:200]}")
            for name in runs:
                print(
                    f"  run {name}: at step {steps[name]}, restored to {restored[name]}: "
                    f"{steps[name] - restored[name]} step(s) lost"
                )
            sc.close("success")


if __name__ == "__main__":
    main()
