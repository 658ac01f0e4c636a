"""Many SDK clients at once on one ``ringtune serve --cp 2``: every future resolves, no 5xx, each training run's
losses equal the same run replayed alone, latency per verb, and fairness between clients.

Run ``python benchmarks/service_load.py [--steps 60] [--quick]`` (127.0.0.1 only, bounded loops).

One server (``ringtune serve --cp 2`` as a child process, float32, a tiny random Qwen3.5: 4 layers, hidden 32,
vocab 96, GatedDeltaNet and attention layers) and 8 SDK clients, each a thread with its own
``tinker.ServiceClient`` (its own session):

- 4 trainers: ``forward_backward`` + ``optim_step`` on fixed data (8 datums of 5-40 tokens, seed = client),
  ``--steps`` steps, the two ops pipelined as the SDK does; the losses are recorded;
- 4 queriers, until the trainers are done: ``forward`` on a run of their own, ``compute_logprobs`` and
  ``sample`` (8 new tokens) on the base model. Querier 0 also sends one long ``sample`` (a generation filling
  the served context) once the trainers are a third of the way through; querier 1 sends a burst of
  ``--burst`` ``forward`` futures at once at two thirds.

Printed, all measured in this run:
1. per verb: count, p50 / p95 / max latency (submit to result, seconds);
2. futures: every one resolved (a failure is printed with its error), and the server log has no 5xx / internal
   error / traceback;
3. replay: each trainer's run again, alone (nothing else on the server), from a fresh run: its losses must
   equal the loaded run's bit for bit (float32 on the same ranks, the same data in the same order: the ranks
   run one command at a time, so other clients' work changes nothing in a run's numbers);
4. fairness: (a) the long generation took L s; short requests of other clients sent while it ran waited at
   most M s: goal M <= L + the p95 of their verb (one request can delay others by its own length, never more);
   (b) querier 1's burst of B forwards took T s; requests of other clients sent while it ran waited at most
   W s: goal W <= T / 2 (a FIFO backend thread makes a request sent at the burst's start wait for all of it,
   W near T; the gateway's round-robin over runs, ``gateway/scheduler.py``, serves about one op of each busy
   run per round, W near T x busy runs / B). Also printed: the most burst ops that completed while one such
   request waited (observed by the client, so inflated when the client process itself is starved of CPU).

``--quick``: 3 steps, a burst of 8, a short long-generation (under a minute on an idle 2-core machine;
exercised by ``tests/test_service_load.py``); its fairness figures are printed, not judged (a burst of 8 is
about one round of the 9 busy queues). Exit status 0 when every judged check passes.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import tinker
import torch

from ringtune.gateway.serve_process import ServeProcess

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.tiny_models import hf_model

API_KEY = "tml-load"
BUDGET = 256
"""Per-rank tokens: context 512 at CP=2."""
LENS = (5, 17, 3, 11, 2, 9, 13, 40)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
ADAM = tinker.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
SERVER_FAULT = re.compile(r"internal error|Traceback|unhandled error| 50[0-9] ")


@dataclass
class Record:
    """Every request of the run: (client, verb, submitted, done, error or None); thread-safe appends."""

    rows: list[tuple[str, str, float, float, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, client: str, verb: str, submit, *, timeout_s: float = 600.0):
        """``submit()`` returns an SDK future; its result, recorded with the latency (errors recorded, re-raised)."""
        start = time.monotonic()
        try:
            result = submit().result(timeout=timeout_s)
        except Exception as exc:
            self.add(client, verb, start, time.monotonic(), f"{type(exc).__name__}: {exc}")
            raise
        self.add(client, verb, start, time.monotonic(), None)
        return result

    def add(self, client: str, verb: str, start: float, done: float, error: str | None) -> None:
        with self.lock:
            self.rows.append((client, verb, start, done, error))


def datums(seed: int) -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENS:
        tokens = torch.randint(0, 90, (n,), generator=gen).tolist()
        targets = torch.randint(0, 90, (n,), generator=gen).tolist()
        weights = torch.rand(n, generator=gen).tolist()
        inputs = {"target_tokens": targets, "weights": weights}
        out.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs))
    return out


def train(url: str, base: str, seed: int, steps: int, record: Record | None, progress: list[int]) -> list[float]:
    """A training run of ``steps`` steps on fixed data; its per-step ``loss:sum``."""
    client = f"trainer{seed}"
    data, losses = datums(seed), []
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(base, rank=0).result()
        for step in range(steps):
            start = time.monotonic()
            fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(ADAM)
            out = fb.result(timeout=600)
            fb_done = time.monotonic()
            opt.result(timeout=600)
            if record is not None:
                record.add(client, "forward_backward", start, fb_done, None)
                record.add(client, "optim_step", start, time.monotonic(), None)
            losses.append(float(out.metrics["loss:sum"]))
            progress[seed] = step + 1
    return losses


@dataclass
class Plan:
    steps: int
    burst: int
    long_tokens: int
    context: int
    judge_fairness: bool = True


def query(url: str, base: str, index: int, plan: Plan, record: Record, progress: list[int], done: threading.Event):
    """Forward / compute_logprobs / sample until ``done``; querier 0 sends the long generation, 1 the burst."""
    client = f"querier{index}"
    data = datums(100 + index)[:4]
    short = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=index, stop=[])
    prompt = tinker.ModelInput.from_ints(PROMPT)
    long_sent, burst_sent = index != 0, index != 1
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(base, rank=0).result()
        sampler = sc.create_sampling_client(base_model=base).result()
        while not done.is_set():
            record.timed(client, "forward", lambda: tc.forward(data, "cross_entropy"))
            record.timed(client, "compute_logprobs", lambda: sampler.compute_logprobs(prompt))
            record.timed(client, "sample", lambda: sampler.sample(prompt, 1, short))
            least = min(progress[:4])
            if not long_sent and least >= max(1, plan.steps // 3):
                long_sent = True
                params = tinker.SamplingParams(max_tokens=plan.long_tokens, temperature=1.0, seed=7, stop=[])
                record.timed(client, "long_sample", lambda p=params: sampler.sample(prompt, 1, p))
            if not burst_sent and least >= max(2, 2 * plan.steps // 3):
                burst_sent = True
                start = time.monotonic()
                futures = [tc.forward(data, "cross_entropy") for _ in range(plan.burst)]
                for future in futures:  # they complete in order (one run's ops): each time is its completion's
                    future.result(timeout=600)
                    record.add(client, "burst_op", start, time.monotonic(), None)
                record.add(client, "burst", start, time.monotonic(), None)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def fairness(rows, window: str, owner: str) -> tuple[float, float, list[float]]:
    """(duration of ``owner``'s ``window`` request, its start, latencies of other clients' short requests sent
    while it ran)."""
    found = [r for r in rows if r[1] == window and r[0] == owner and r[4] is None]
    if not found:
        return float("nan"), float("nan"), []
    _, _, start, end, _ = found[0]
    short = ("forward", "compute_logprobs", "sample", "forward_backward", "optim_step")
    waits = [d - s for c, v, s, d, e in rows if c != owner and v in short and start <= s <= end and e is None]
    return end - start, start, waits


def run(plan: Plan, workdir: Path) -> bool:
    model_dir = workdir / "model"
    hf_model("qwen3_5", seed=0).save_pretrained(model_dir)
    base = str(model_dir)
    args = ["--cp", "2", "--max-tokens-per-rank", str(BUDGET), "--log-level", "warning", "--max-live-runs", "12"]
    log_path = workdir / "serve.log"
    ok = True
    server = ServeProcess(base, checkpoint_root=workdir / "ckpt", log_path=log_path, api_key=API_KEY, extra_args=args)
    with server:
        url = server.url
        record, progress, done = Record(), [0] * 4, threading.Event()
        losses: dict[int, list[float]] = {}
        failures: list[str] = []

        def guarded(name: str, fn) -> None:
            try:
                result = fn()
                if name.startswith("trainer"):
                    losses[int(name[-1])] = result
            except Exception as exc:  # every future must resolve: a failure is reported
                failures.append(f"{name}: {type(exc).__name__}: {exc}")

        start = time.monotonic()
        trainers = [
            threading.Thread(
                target=guarded, args=(f"trainer{i}", lambda i=i: train(url, base, i, plan.steps, record, progress))
            )
            for i in range(4)
        ]
        queriers = [
            threading.Thread(
                target=guarded, args=(f"querier{i}", lambda i=i: query(url, base, i, plan, record, progress, done))
            )
            for i in range(4)
        ]
        for t in trainers + queriers:
            t.start()
        for t in trainers:
            t.join()
        done.set()
        for t in queriers:
            t.join()
        loaded_s = time.monotonic() - start
        rows = list(record.rows)
        print(f"load: 8 clients (4 trainers x {plan.steps} steps, 4 queriers) for {loaded_s:.1f} s on CP=2")
        by_verb: dict[str, list[float]] = defaultdict(list)
        for _, verb, s, d, error in rows:
            if error is None:
                by_verb[verb].append(d - s)
        print(f"{'verb':<18}{'count':>6}{'p50 s':>9}{'p95 s':>9}{'max s':>9}")
        for verb, values in sorted(by_verb.items()):
            print(
                f"{verb:<18}{len(values):>6}{statistics.median(values):>9.3f}{percentile(values, 0.95):>9.3f}"
                f"{max(values):>9.3f}"
            )
        errors = [r for r in rows if r[4] is not None]
        for failure in failures + [f"{c} {v}: {e}" for c, v, _, _, e in errors]:
            print(f"FAILED future: {failure}")
        ok &= not failures and not errors
        print(f"futures: {len(rows)} resolved, {len(errors) + len(failures)} failed")

        long_s, _, long_waits = fairness(rows, "long_sample", "querier0")
        p95 = {v: percentile(x, 0.95) for v, x in by_verb.items()}
        slack = max(p95.get(v, 0.0) for v in ("forward", "compute_logprobs", "sample", "optim_step"))
        worst = max(long_waits, default=0.0)
        fair_long = worst <= long_s + slack
        print(
            f"fairness (long generation, {plan.long_tokens} tokens): took {long_s:.2f} s; {len(long_waits)} short "
            f"requests of others sent during it waited at most {worst:.2f} s (goal <= {long_s:.2f} + p95 "
            f"{slack:.2f} s): {'PASS' if fair_long else 'FAIL'}"
        )
        burst_s, burst_start, burst_waits = fairness(rows, "burst", "querier1")
        ops_done = [d for c, v, _, d, _ in rows if c == "querier1" and v == "burst_op"]
        short = ("forward", "compute_logprobs", "sample", "forward_backward", "optim_step")
        others = [(s, d) for c, v, s, d, e in rows if c != "querier1" and v in short and e is None]
        overtaken = [sum(s < t < d for t in ops_done) for s, d in others if burst_start <= s <= burst_start + burst_s]
        worst_b, most = max(burst_waits, default=0.0), max(overtaken, default=0)
        fair_burst = worst_b <= burst_s / 2
        print(
            f"fairness (burst of {plan.burst} forwards by one client): took {burst_s:.2f} s; {len(burst_waits)} "
            f"requests of others sent during it waited at most {worst_b:.2f} s, {worst_b / burst_s:.2f} of the "
            f"burst (goal <= 0.5; FIFO: near 1); at most {most} of the burst's ops completed while one of them "
            f"waited (client-observed): {'PASS' if fair_burst else 'FAIL'}"
        )
        if plan.judge_fairness:  # --quick: a burst of 8 is about one round of 9 busy queues, too short to judge
            ok &= fair_long and fair_burst and bool(long_waits) and bool(burst_waits)

        start = time.monotonic()
        replayed = {i: train(url, base, i, plan.steps, None, [0] * 4) for i in range(4)}
        equal = all(replayed[i] == losses.get(i) for i in range(4))
        print(
            f"replay: 4 runs x {plan.steps} steps alone in {time.monotonic() - start:.1f} s; losses equal to the "
            f"loaded runs bit for bit: {'PASS' if equal else 'FAIL'}"
        )
        for i in range(4):
            if replayed[i] != losses.get(i):
                print(f"  trainer{i}: loaded {losses.get(i)}\n  replayed {replayed[i]}")
        ok &= equal
        log = log_path.read_text()
        faults = [line for line in log.splitlines() if SERVER_FAULT.search(line)]
        print(f"server log: {len(faults)} lines with a 5xx / internal error / traceback")
        for line in faults[:10]:
            print(f"  {line}")
        ok &= not faults
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run")
    parser.add_argument("--burst", type=int, default=32, help="forwards one client sends at once")
    parser.add_argument("--long-tokens", type=int, default=400, help="tokens of the long generation")
    parser.add_argument("--quick", action="store_true", help="3 steps, a burst of 8, 60 long tokens")
    args = parser.parse_args(argv)
    plan = Plan(steps=args.steps, burst=args.burst, long_tokens=args.long_tokens, context=2 * BUDGET)
    if args.quick:
        plan = Plan(steps=3, burst=8, long_tokens=60, context=2 * BUDGET, judge_fairness=False)
    with tempfile.TemporaryDirectory(prefix="service-load-") as tmp:
        return 0 if run(plan, Path(tmp)) else 1


if __name__ == "__main__":
    sys.exit(main())
