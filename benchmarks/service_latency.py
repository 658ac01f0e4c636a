"""Short requests of 4 clients while one client generates a whole context: latency, and the mesh after it.

Run ``python benchmarks/service_latency.py [--context 1024] [--baseline-s 30] [--clients 4]``.

One server (``ringtune serve --model smollm2-135m --cp 2 --context-length <context>``, a child on 127.0.0.1).
``--clients`` clients each open a sampling session on the base model and loop short requests (a 16-token
prompt, ``max_tokens=4``, greedy), each waiting for its answer before the next:

1. **baseline** for ``--baseline-s`` seconds: p50 / p95 / max latency of the short requests;
2. **long generation**: another client asks for ``max_tokens = context - prompt`` (the served context, from
   ``get_server_capabilities``; no stop: the whole context,
   the longest request the server accepts); the short requests go on until it is answered: their p50 / p95 /
   max latency during it, and its own duration;
3. **refused**: one token more (``max_tokens = context - prompt + 1``) is a ``user`` error naming both limits;
4. healthz after it all (must be 200) and one more short request (must work).

Printed: the figures above, and the p95 ratio during / baseline. The long generation decodes in turns of
``--sample-slice`` seconds (the server's flag; 0 = the old behaviour, one uninterrupted command), so the short
requests go on during it. Goals (PASS/FAIL): the long request completes, the refused one is a user error, the
mesh is healthy afterwards, and (with slicing on) short requests during it are served: p95 during under a
quarter of the long generation's duration.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import tinker

from ringtune.gateway.serve_process import ServeProcess

API_KEY = "tml-latency"
PROMPT = list(range(1000, 1016))
SHORT = tinker.SamplingParams(max_tokens=4, temperature=0.0, stop=[])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


class ShortClient(threading.Thread):
    """Loops short sampling requests; each latency is filed under the current ``phase``."""

    def __init__(self, url: str, model: str, phase: list[str]) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.phase, self.stop = url, model, phase, threading.Event()
        self.latencies: dict[str, list[float]] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        with tinker.ServiceClient(base_url=self.url, api_key=API_KEY) as sc:
            sampler = sc.create_sampling_client(base_model=self.model).result()
            prompt = tinker.ModelInput.from_ints(PROMPT)
            while not self.stop.is_set():
                phase, start = self.phase[0], time.monotonic()
                try:
                    sampler.sample(prompt, 1, SHORT).result(timeout=1800)
                except Exception as exc:  # counted and printed, never hidden
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.latencies.setdefault(phase, []).append(time.monotonic() - start)


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name:22s} no requests"
    return (
        f"{name:22s} {len(values):5d} requests  p50 {statistics.median(values):7.2f} s  "
        f"p95 {pct(values, 0.95):7.2f} s  max {max(values):7.2f} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--baseline-s", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sample-slice", type=float, default=0.5, help="the server's --sample-slice (0: off)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ringtune-latency-"))
    extra = ["--cp", "2", "--context-length", str(args.context), "--sample-slice", str(args.sample_slice)]
    server = ServeProcess(
        args.model, checkpoint_root=tmp / "ckpt", log_path=tmp / "serve.log", api_key=API_KEY, extra_args=extra
    )
    phase = ["warm-up"]
    print(f"starting {server.command} ...", flush=True)
    with server:
        clients = [ShortClient(server.url, args.model, phase) for _ in range(args.clients)]
        for c in clients:
            c.start()
        time.sleep(5)
        phase[0] = "baseline"
        time.sleep(args.baseline_s)
        caps = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY}).json()
        context = caps["supported_models"][0]["max_context_length"]  # served: --context-length rounded up
        print(f"baseline done; long generation of {context - len(PROMPT)} tokens ...", flush=True)
        with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as sc:
            sampler = sc.create_sampling_client(base_model=args.model).result()
            prompt = tinker.ModelInput.from_ints(PROMPT)
            long_params = tinker.SamplingParams(max_tokens=context - len(PROMPT), temperature=0.0, stop=[])
            phase[0] = "during long generation"
            start = time.monotonic()
            generated = len(sampler.sample(prompt, 1, long_params).result(timeout=3600).sequences[0].tokens)
            long_s = time.monotonic() - start
            phase[0] = "after"
            try:
                over = tinker.SamplingParams(max_tokens=context - len(PROMPT) + 1, stop=[])
                sampler.sample(prompt, 1, over).result(timeout=600)
                refused = "accepted (wrong)"
            except tinker.BadRequestError as exc:  # refused when it arrives: a JSON 400
                refused = f"{exc.body.get('category')}: {exc.body.get('error')}"
            time.sleep(5)
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(timeout=600)
        health = httpx.get(f"{server.url}/api/v1/healthz", timeout=10).status_code
    print(
        f"\nserver: ringtune serve --model {args.model} --cp 2 --context-length {args.context} (served: {context}); "
        f"{args.clients} clients; --sample-slice {args.sample_slice}"
    )
    print(f"long generation: {generated} tokens (max_tokens = served context - prompt) in {long_s:.1f} s")
    merged: dict[str, list[float]] = {}
    for c in clients:
        for name, values in c.latencies.items():
            merged.setdefault(name, []).extend(values)
    for name in ("baseline", "during long generation", "after"):
        print(summary(name, merged.get(name, [])))
    base, during = merged.get("baseline", []), merged.get("during long generation", [])
    if base and during:
        print(f"short-request p95 during / baseline: {pct(during, 0.95) / pct(base, 0.95):.1f}x")
    errors = [e for c in clients for e in c.errors]
    print(f"short requests failed: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    print(f"max_tokens = served context - prompt + 1: {refused}")
    print(f"healthz afterwards: {health}")
    ok = generated == context - len(PROMPT) and refused.startswith("user") and health == 200 and not errors
    print(f"goal: long request completes, over-context refused as user error, mesh healthy: {'PASS' if ok else 'FAIL'}")
    if args.sample_slice > 0:
        served = bool(during) and pct(during, 0.95) < long_s / 4
        print(f"goal: short requests served during it (p95 < {long_s / 4:.1f} s): {'PASS' if served else 'FAIL'}")
        ok = ok and served
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
