"""Does ``ringtune serve --cp 2`` stay up: idle, beside busy processes, working, with a rank stopped?

Run ``python benchmarks/service_soak.py [--idle-s 600] [--busy-s 300] [--busy-procs 8] [--stop-s 30]``
(``--quick``: 60 / 30 / 8 / 15).

One server (``ringtune serve --model smollm2-135m --cp 2``, a child process on 127.0.0.1) goes through:

1. **idle** ``--idle-s`` seconds, nobody calls it;
2. **busy, idle server**: ``--busy-procs`` spinning processes (``timeout <s> python -c 'while True: pass'``)
   for ``--busy-s`` seconds;
3. **busy, working server**: the same busy processes, while one SDK client loops ``forward_backward`` on a
   short batch for ``--busy-s`` seconds (each result must equal the first one: no optim_step);
4. **stopped rank**: the worker rank SIGSTOPped for ``--stop-s`` seconds with a ``forward_backward`` in flight,
   then SIGCONT: the request must complete with the same result.

A thread polls ``/api/v1/healthz`` every second from start to end. Printed per phase: polls, non-200 answers,
requests done / failed; then the server log's lines that report a dead rank ("false deaths": every rank was
alive throughout). Goal: 0 non-200, 0 failed requests, 0 false deaths (PASS/FAIL).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import tinker
import torch

from ringtune.gateway.serve_process import ServeProcess, worker_pids

API_KEY = "tml-soak"
DEATH = re.compile(r"is gone|exited|RankDied|its process ended|no heartbeat|cannot serve|restarting", re.IGNORECASE)


class HealthPoller(threading.Thread):
    """Polls healthz every second; ``phase`` names where the answers are counted."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.phase, self.stop = url, "start", threading.Event()
        self.counts: dict[str, list[int]] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                code = httpx.get(f"{self.url}/api/v1/healthz", timeout=10).status_code
            except httpx.HTTPError:
                code = 0
            polls, bad = self.counts.setdefault(self.phase, [0, 0])
            self.counts[self.phase] = [polls + 1, bad + (code != 200)]
            self.stop.wait(1.0)


def datums() -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in (64, 200, 32):
        ids = torch.randint(0, 49152, (n + 1,), generator=gen).tolist()
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n},
            )
        )
    return out


def spinners(count: int, seconds: float) -> list[subprocess.Popen]:
    """``count`` spinning processes, each in a process group of its own (``timeout`` and its child)."""
    command = ["timeout", str(int(seconds)), sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(command, start_new_session=True) for _ in range(count)]


def end_spinners(procs: list[subprocess.Popen]) -> None:
    """Kill each spinner's whole group (killing ``timeout`` alone would orphan its spinning child)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-s", type=float, default=600.0)
    ap.add_argument("--busy-s", type=float, default=300.0)
    ap.add_argument("--busy-procs", type=int, default=8)
    ap.add_argument("--stop-s", type=float, default=30.0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true", help="--idle-s 60 --busy-s 30 --stop-s 15")
    args = ap.parse_args()
    if args.quick:
        args.idle_s, args.busy_s, args.stop_s = 60.0, 30.0, 15.0
    tmp = Path(tempfile.mkdtemp(prefix="ringtune-soak-"))
    server = ServeProcess(
        args.model,
        checkpoint_root=tmp / "ckpt",
        log_path=tmp / "serve.log",
        api_key=API_KEY,
        extra_args=["--cp", "2", "--context-length", "1024", "--log-level", "info"],
    )
    requests: dict[str, list[int]] = {}
    with server:
        poller = HealthPoller(server.url)
        poller.start()
        data = datums()
        with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as sc:
            poller.phase = "1 idle"
            print(f"[1] idle {args.idle_s:.0f} s ...", flush=True)
            time.sleep(args.idle_s)

            poller.phase = "2 busy, idle server"
            print(f"[2] {args.busy_procs} busy processes, idle server, {args.busy_s:.0f} s ...", flush=True)
            procs = spinners(args.busy_procs, 2 * args.busy_s + 600)
            try:
                time.sleep(args.busy_s)
                poller.phase = "3 busy, working server"
                print(f"[3] busy processes, one client stepping, {args.busy_s:.0f} s ...", flush=True)
                tc = sc.create_lora_training_client(args.model, rank=0).result()
                first = tc.forward_backward(data, "cross_entropy").result(timeout=600).metrics
                done = requests.setdefault(poller.phase, [0, 0])
                end = time.monotonic() + args.busy_s
                while time.monotonic() < end:
                    try:
                        same = tc.forward_backward(data, "cross_entropy").result(timeout=600).metrics == first
                        done[0 if same else 1] += 1
                    except tinker.RequestFailedError as exc:
                        print(f"  request failed: {exc}", flush=True)
                        done[1] += 1
            finally:
                end_spinners(procs)

            poller.phase = "4 rank stopped"
            print(f"[4] worker rank SIGSTOPped {args.stop_s:.0f} s with a forward_backward in flight ...", flush=True)
            pid = worker_pids(server.proc.pid)[0]
            done = requests.setdefault(poller.phase, [0, 0])
            os.kill(pid, signal.SIGSTOP)
            try:
                future = tc.forward_backward(data, "cross_entropy")
                time.sleep(args.stop_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            try:
                done[0 if future.result(timeout=600).metrics == first else 1] += 1
            except tinker.RequestFailedError as exc:
                print(f"  request failed: {exc}", flush=True)
                done[1] += 1
            poller.phase = "5 after"
            time.sleep(3)
        poller.stop.set()
        poller.join()
        log = server.log_path.read_text(errors="replace")
    deaths = [line for line in log.splitlines() if DEATH.search(line)]
    print(f"\nserver: ringtune serve --model {args.model} --cp 2 --context-length 1024; log {server.log_path}")
    print(f"{'phase':28s} {'healthz polls':>14s} {'non-200':>8s} {'requests ok':>12s} {'failed/wrong':>13s}")
    bad_total = 0
    for phase, (polls, bad) in poller.counts.items():
        ok, failed = requests.get(phase, [0, 0])
        bad_total += bad + failed
        print(f"{phase:28s} {polls:14d} {bad:8d} {ok:12d} {failed:13d}")
    print(f"false deaths in the server log: {len(deaths)}")
    for line in deaths[:10]:
        print(f"  {line}")
    verdict = "PASS" if bad_total == 0 and not deaths else "FAIL"
    print(f"goal: 0 non-200, 0 failed requests, 0 false deaths: {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
