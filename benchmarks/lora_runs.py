"""How many LoRA runs does one ``ringtune serve --cp 2`` hold, and what does one more cost per rank?

Run ``python benchmarks/lora_runs.py [--runs 40] [--rank 32] [--min-available-gib 3]``.

One server (``ringtune serve --model smollm2-135m --cp 2 --max-live-runs <runs+1>``, a child on 127.0.0.1) gets
LoRA runs (``create_lora_training_client(base, rank=R)``, every target group) one after another; each run does
one ``forward_backward`` (8 datums of 64 tokens) and one ``optim_step``, so its adapters, and AdamW moments
exist (gradients are dropped by the step). After each run the resident memory (RSS, /proc) of both ranks is
read: rank 0 (the server process) and rank 1 (its spawned worker). Printed: RSS after the base (the first
create loads it) and after every run; the mean per-rank cost of one more run (slope over the runs after the
first); how many runs were held, and whether every one of them still answers a forward afterwards. It stops
early when the machine's MemAvailable falls under ``--min-available-gib`` (the machine is shared).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import tinker
import torch

from ringtune.gateway.serve_process import ServeProcess, worker_pids

MODEL = "smollm2-135m"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def datums(vocab: int, seed: int) -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(8):
        tokens = torch.randint(0, vocab, (65,), generator=gen).tolist()
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 64},
            )
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--min-available-gib", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--cp", "2", "--max-live-runs", str(args.runs + 1)]
        server = ServeProcess(
            MODEL, checkpoint_root=Path(tmp) / "ckpt", log_path=Path(tmp) / "serve.log", extra_args=extra
        )
        with server:
            assert server.proc is not None
            pids = [server.proc.pid, *worker_pids(server.proc.pid)]  # rank 0 (the server), its worker ranks
            print(f"ranks: {pids}; RSS at start (GiB): {[round(rss_bytes(p) / 2**30, 3) for p in pids]}")
            clients = []
            rows: list[list[int]] = []
            with tinker.ServiceClient(base_url=server.url, api_key=server.api_key) as sc:
                data = None
                for i in range(args.runs):
                    if available_bytes() < args.min_available_gib * 2**30:
                        print(f"stopping: MemAvailable {available_bytes() / 2**30:.2f} GiB < {args.min_available_gib}")
                        break
                    t0 = time.monotonic()
                    tc = sc.create_lora_training_client(MODEL, rank=args.rank, seed=i).result()
                    if data is None:
                        data = datums(tc.get_tokenizer().vocab_size, 0)
                    tc.forward_backward(data, "cross_entropy").result()
                    metrics = tc.optim_step(tinker.AdamParams(learning_rate=1e-4)).result().metrics
                    clients.append(tc)
                    rows.append([rss_bytes(p) for p in pids])
                    gib = [round(b / 2**30, 3) for b in rows[-1]]
                    print(
                        f"run {i + 1}: RSS per rank (GiB) {gib}; step {metrics['step:max']:.0f}; "
                        f"{time.monotonic() - t0:.1f} s; MemAvailable {available_bytes() / 2**30:.2f} GiB",
                        flush=True,
                    )
                alive = sum(
                    1 for tc in clients if tc.forward(data[:1], "cross_entropy").result().metrics["loss:sum"] > 0
                )
            if len(rows) >= 3:
                n = len(rows) - 1
                slopes = [(rows[-1][r] - rows[0][r]) / n / 2**20 for r in range(len(pids))]
                later = rows[1:]  # increments from run 2 on (run 1 also pays one-off allocations)
                steps = [sorted(b[r] - a[r] for a, b in itertools.pairwise(later)) for r in range(len(pids))]
                medians = [round(s[len(s) // 2] / 2**20, 1) for s in steps]
                print(f"median increment per added run from run 2 on (MiB per rank): {medians}")
                print(
                    f"per-rank cost of one more rank-{args.rank} LoRA run (MiB, runs 1->{len(rows)}): "
                    f"{[round(s, 1) for s in slopes]}"
                )
            print(f"LoRA runs held: {len(clients)}; answering a forward afterwards: {alive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
