"""Context-parallel attention on CPU/gloo: memory, bytes, load balance and speed, each against its goal.

Run ``python benchmarks/attention_cp.py [--tokens 16384] [--quick]``. Every figure is a ratio measured
inside this one run (the machine is shared, so absolute timings are noise); each line prints the
value, the goal and PASS/FAIL. See benchmarks/README.md for what each figure means.

1. peak memory of ring attention forward+backward per rank, C=4 over C=1 (fresh processes each);
2. bytes each rank sends in the ring forward over the minimum (C-1)/C of the global K+V;
3. max/mean attention work over ranks, zigzag vs a contiguous split (pure index math);
4. time of ringtune's ring against PyTorch's experimental ring (``_templated_ring_attention``).

Workers run in processes started by :func:`ringtune.parallel.spawn`, so they live at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtune.layout.zigzag import ZigzagPlan, zigzag_plan, zigzag_slice
from ringtune.ops.attention import cp_attention_fn, ring_attention
from ringtune.ops.attention.schedule import contiguous_split_work, ring_work
from ringtune.parallel import measure_comm, spawn

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import tensor_peak_bytes

MIB = 1024 * 1024
QUICK_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """Heads and head dim of one attention layer; float32 throughout."""

    heads: int
    kv_heads: int
    head_dim: int

    def describe(self) -> str:
        return f"Hq={self.heads} Hkv={self.kv_heads} D={self.head_dim} float32"


GQA_SHAPE = AttentionShape(heads=16, kv_heads=4, head_dim=128)  # Qwen3.5-style full-attention layer
MHA_SHAPE = AttentionShape(heads=8, kv_heads=8, head_dim=128)  # torch's ring has no GQA: Hq == Hkv


def verdict(value: float, goal: float, *, at_most: bool = True) -> str:
    """'PASS' when ``value`` meets ``goal`` (``value <= goal`` if ``at_most``, else ``value == goal`` to 1e-9)."""
    ok = value <= goal + 1e-12 if at_most else abs(value - goal) <= 1e-9
    return "PASS" if ok else "FAIL"


# ---------------------------------------------------------------- figure 1 and 2: memory and bytes


def _proc_status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no field {field}")


def reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0, clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints a line at every profiler start and stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _random_shard(plan: ZigzagPlan, heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(plan.local_len, heads, head_dim, generator=gen)


def memory_worker(rank: int, mode: str, tokens: int, shape: AttentionShape) -> dict[str, Any]:
    """Peak RSS and bytes sent of one forward+backward of CP attention ``mode`` on one ``tokens``-long sequence.

    Runs on every rank of a fresh process group of size C (the world). A tiny forward+backward first
    warms up the kernels, thread pools and gloo connections (one-time costs that are not attention
    memory); then the RSS high-water mark is reset, the RSS read (the baseline), this rank's shard of
    q, k, v and dout is created (these count) and forward+backward run; peak = VmHWM - baseline.
    """
    group = dist.group.WORLD
    cp = dist.get_world_size()
    fn = cp_attention_fn(mode)
    gen = torch.Generator().manual_seed(1000 + rank)

    warm = zigzag_plan([2 * cp * 64], cp_size=cp, cp_rank=rank)
    q, k, v = (_random_shard(warm, h, shape.head_dim, gen) for h in (shape.heads, shape.kv_heads, shape.kv_heads))
    for x in (q, k, v):
        x.requires_grad_()
    out, _ = fn(q, k, v, warm, group)
    out.sum().backward()
    del q, k, v, out
    gc.collect()
    dist.barrier()

    plan = zigzag_plan([tokens], cp_size=cp, cp_rank=rank)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    reset_peak_rss()
    base_kib = _proc_status_kib("VmRSS")
    q = _random_shard(plan, shape.heads, shape.head_dim, gen).requires_grad_()
    k = _random_shard(plan, shape.kv_heads, shape.head_dim, gen).requires_grad_()
    v = _random_shard(plan, shape.kv_heads, shape.head_dim, gen).requires_grad_()
    dout = _random_shard(plan, shape.heads, shape.head_dim, gen)
    input_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, dout))
    t0 = time.perf_counter()
    with measure_comm() as fwd_meter:
        out, _lse = fn(q, k, v, plan, group)
    with measure_comm() as bwd_meter:
        out.backward(dout)
    seconds = time.perf_counter() - t0
    peak_kib = _proc_status_kib("VmHWM")
    with _quiet_stderr():
        prof.stop()
    return {
        "rss_peak_bytes": (peak_kib - base_kib) * 1024,
        "tensor_peak_bytes": tensor_peak_bytes(prof),
        "input_bytes": input_bytes,
        "fwd_sent": fwd_meter.bytes_sent,
        "bwd_sent": bwd_meter.bytes_sent,
        "bwd_by_op": dict(bwd_meter.by_op),
        "local_len": plan.local_len,
        "global_len": plan.global_len,
        "seconds": seconds,
    }


def run_memory(mode: str, cp: int, tokens: int, shape: AttentionShape) -> list[dict[str, Any]]:
    """:func:`memory_worker` on ``cp`` fresh ranks (torch threads = cores // cp, at least 1)."""
    return spawn(memory_worker, cp, mode, tokens, shape)


def min_ring_bytes(global_len: int, shape: AttentionShape, cp: int) -> int:
    """(C-1)/C of the global K+V bytes (float32): what each rank must at least send for the keys it lacks."""
    kv_bytes = 2 * global_len * shape.kv_heads * shape.head_dim * 4
    return (cp - 1) * kv_bytes // cp


def figures_memory_and_bytes(tokens: int, shape: AttentionShape) -> list[bool]:
    cp = 4
    print(f"\n[1] peak memory per rank of attention forward+backward, one {tokens}-token sequence, {shape.describe()}")
    print("    fresh processes per configuration; inputs (this rank's q, k, v, dout) count. tensor = peak live CPU")
    print("    tensor bytes (torch.profiler memory events); RSS = VmHWM - VmRSS before the inputs (glibc malloc)")
    runs = {("ring", 1): run_memory("ring", 1, tokens, shape)}
    for mode in ("ring", "allgather", "alltoall"):
        runs[mode, cp] = run_memory(mode, cp, tokens, shape)
    print(f"    {'config':<16} {'tensor MiB':>10} {'RSS MiB':>9}  {'inputs MiB':>10}  seconds   (max over ranks)")
    for (mode, size), res in runs.items():
        print(
            f"    {mode + ' C=' + str(size):<16} {max(r['tensor_peak_bytes'] for r in res) / MIB:10.1f} "
            f"{max(r['rss_peak_bytes'] for r in res) / MIB:9.1f}  {res[0]['input_bytes'] / MIB:10.1f}  "
            f"{max(r['seconds'] for r in res):7.1f}"
        )
    ok = []
    for label, key in (("tensor", "tensor_peak_bytes"), ("RSS", "rss_peak_bytes")):
        base = runs["ring", 1][0][key]
        info = ", ".join(
            f"{mode} {max(r[key] for r in runs[mode, cp]) / base:.3f}" for mode in ("allgather", "alltoall")
        )
        ratio = max(r[key] for r in runs["ring", cp]) / base
        ok.append(ratio <= 0.30)
        print(
            f"    ring C={cp} / C=1 ({label:<6}) {ratio:.3f}   goal <= 0.30   {verdict(ratio, 0.30)}"
            f"   (info, same C=1 base: {info})"
        )
    ring, others = runs["ring", cp], {mode: runs[mode, cp] for mode in ("allgather", "alltoall")}

    print(f"\n[2] bytes each rank sends per layer at C={cp} (same run as [1]; ringtune collectives incl. ring P2P)")
    minimum = min_ring_bytes(ring[0]["global_len"], shape, cp)
    print(f"    minimum (C-1)/C * global K+V = {minimum / MIB:.2f} MiB (global padded stream {ring[0]['global_len']})")
    fwd = max(r["fwd_sent"] for r in ring)
    bwd = max(r["bwd_sent"] for r in ring)
    bytes_ratio = fwd / minimum
    print(
        f"    ring forward  {fwd / MIB:8.2f} MiB = {bytes_ratio:.3f} x minimum   goal 1.0   "
        f"{verdict(bytes_ratio, 1.0, at_most=False)}"
    )
    print(f"    ring backward {bwd / MIB:8.2f} MiB = {bwd / minimum:.3f} x minimum (info: K/V again, dK/dV in float32)")
    for mode, res in others.items():
        f_sent = max(r["fwd_sent"] for r in res)
        b_sent = max(r["bwd_sent"] for r in res)
        print(
            f"    {mode:<9} fwd {f_sent / MIB:8.2f} MiB = {f_sent / minimum:.3f} x, "
            f"bwd {b_sent / MIB:8.2f} MiB = {b_sent / minimum:.3f} x (info)"
        )
    return [*ok, abs(bytes_ratio - 1.0) <= 1e-9]


# ---------------------------------------------------------------- figure 3: load balance


def packed_sft_lengths(tokens: int, seed: int = 0) -> list[int]:
    """A seeded packed SFT row of exactly ``tokens`` tokens: mostly short chats, a few long documents.

    About 1 in 8 sequences is long (uniform in [tokens/16, tokens/3]); the others are log-normal around
    400 tokens, clipped to [8, tokens/16]. The last sequence is cut so the row sums to ``tokens``.
    """
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        if rng.random() < 0.125:
            n = rng.randint(tokens // 16, tokens // 3)
        else:
            n = int(min(max(rng.lognormvariate(6.0, 0.9), 8), tokens // 16))
        lens.append(min(n, tokens - sum(lens)))
    return lens


def imbalance(work: list[int]) -> float:
    """max / mean of per-rank work."""
    return max(work) / (sum(work) / len(work))


def figure_load_balance(tokens: int) -> list[bool]:
    rows = {"packed SFT": packed_sft_lengths(tokens), "one sequence": [tokens]}
    sft = rows["packed SFT"]
    print(f"\n[3] attention work (query-key scores) max/mean over ranks, {tokens} tokens")
    print(f"    packed SFT row: {len(sft)} sequences, longest {max(sft)}, median {int(statistics.median(sft))}")
    ok = []
    for name, lens in rows.items():
        for cp in (2, 4, 8):
            plan = zigzag_plan(lens, cp_size=cp, cp_rank=0)
            zig = imbalance([ring_work(plan.for_rank(r)) for r in range(cp)])
            contiguous = imbalance(contiguous_split_work(lens, cp))
            ok.append(zig <= 1.02)
            print(
                f"    {name:<13} C={cp}  zigzag {zig:.3f}  contiguous {contiguous:.3f}   goal zigzag <= 1.02   "
                f"{verdict(zig, 1.02)}"
            )
    return ok


# ---------------------------------------------------------------- figure 4: speed against torch's ring


def torch_cpu_flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash op with the keyword signature ``_templated_ring_attention`` calls; [B, H, S, D] -> (out, lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)


def torch_cpu_flash_backward(
    *,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash backward with the keyword signature ``_templated_ring_attention_backward`` calls."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale
    )


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> contiguous [1, H, S, D]."""
    return x.permute(1, 0, 2).unsqueeze(0).contiguous()


def speed_worker(rank: int, tokens: int, shape: AttentionShape, reps: int) -> dict[str, Any]:
    """Time ringtune's ring and torch's ``_templated_ring_attention`` on the same zigzag shard of one sequence.

    Torch's load-balanced ring takes the head/tail shard (chunks r and 2C-1-r), which is our zigzag shard of
    a single sequence when the local stream needs no stream pad. Inputs: ours THD [S_local, H, D], torch's
    [1, H, S_local, D] of the same values. One warm-up call of each, then ``reps`` rounds of (ours, theirs),
    each a forward and a backward, with a barrier before each call. Returns per-rank seconds and the max
    abs differences of out, lse, dq, dk, dv between the two.
    """
    import torch.distributed.tensor.experimental._context_parallel._attention as torch_cp

    torch_cp._cp_options.enable_load_balance = True  # the head/tail (zigzag) layout; torch's default too
    group = dist.group.WORLD
    cp = dist.get_world_size()
    plan = zigzag_plan([tokens], cp_size=cp, cp_rank=rank)
    if plan.stream_pad_len or plan.real_local_len * cp != tokens:
        raise ValueError(f"tokens={tokens} must split into 2C equal chunks with no stream pad at C={cp}")
    gen = torch.Generator().manual_seed(0)  # same full tensors on every rank, then this rank's shard
    full = [torch.randn(tokens, shape.heads, shape.head_dim, generator=gen) for _ in range(4)]
    q, k, v, dout = (zigzag_slice(x, plan) for x in full)
    del full
    q_t, k_t, v_t, dout_t = (_heads_major(x) for x in (q, k, v, dout))
    scale = shape.head_dim**-0.5

    def ours() -> tuple[float, float, list[torch.Tensor]]:
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        dist.barrier()
        t0 = time.perf_counter()
        out, lse = ring_attention(*leaves, plan, group, scale=scale)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, [out.detach(), lse, *(x.grad for x in leaves)]

    def theirs() -> tuple[float, float, list[torch.Tensor]]:
        dist.barrier()
        t0 = time.perf_counter()
        out, lse = torch_cp._templated_ring_attention(
            group, 2, torch_cpu_flash, q_t, k_t, v_t, is_causal=True, scale=scale
        )
        t1 = time.perf_counter()
        dq, dk, dv = torch_cp._templated_ring_attention_backward(
            group,
            2,
            torch_cpu_flash_backward,
            dout_t,
            "grad_out",
            q_t,
            k_t,
            v_t,
            out,
            lse,
            is_causal=True,
            scale=scale,
        )
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, [out, lse, dq, dk, dv]

    _, _, mine = ours()
    _, _, ref = theirs()
    mine = [_heads_major(mine[0]), mine[1].t().unsqueeze(0), *(_heads_major(g) for g in mine[2:])]
    diffs = [float((a - b).abs().max()) for a, b in zip(mine, ref, strict=True)]
    del mine, ref
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "theirs": []}
    for _ in range(reps):
        for name, fn in (("ours", ours), ("theirs", theirs)):
            fwd, total, _ = fn()
            times[name].append((fwd, total))
    return {"times": times, "diffs": diffs}


def figure_speed(tokens: int, shape: AttentionShape, cps: tuple[int, ...], reps: int) -> list[bool]:
    print(f"\n[4] ring time, ringtune vs torch _templated_ring_attention (load balanced), {tokens} tokens, ")
    print(f"    {shape.describe()}, 1 torch thread per rank, {reps} interleaved rounds after a warm-up, median")
    print("    of the per-round max over ranks; diffs = max abs |ours - torch| of out, lse, dq, dk, dv")
    ok = []
    for cp in cps:
        res = spawn(speed_worker, cp, tokens, shape, reps, threads=1)
        diffs = [max(r["diffs"][i] for r in res) for i in range(5)]
        names = ("out", "lse", "dq", "dk", "dv")
        print(f"    C={cp} diffs " + " ".join(f"{n}={d:.1e}" for n, d in zip(names, diffs, strict=True)))
        for label, idx in (("forward", 0), ("fwd+bwd", 1)):
            med = {}
            for name in ("ours", "theirs"):
                rounds = [max(r["times"][name][i][idx] for r in res) for i in range(reps)]
                med[name] = statistics.median(rounds)
            ratio = med["ours"] / med["theirs"]
            ok.append(ratio <= 1.0)
            print(
                f"    C={cp} {label:<8} ours {med['ours']:7.2f} s  torch {med['theirs']:7.2f} s  "
                f"ratio {ratio:.3f}   goal <= 1.0   {verdict(ratio, 1.0)}"
            )
    return ok


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the row (multiple of 1024)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run at {QUICK_TOKENS} tokens, fewer rounds")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per CP size (default 3, quick 2)")
    parser.add_argument("--speed-cp", type=int, nargs="+", default=[2, 4], help="CP sizes of figure 4")
    parser.add_argument("--figures", type=int, nargs="+", default=[1, 3, 4], help="figures to run (1 runs 1 and 2)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = QUICK_TOKENS
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    if args.tokens < 1024 or args.tokens % 1024:
        parser.error(f"--tokens={args.tokens} must be a positive multiple of 1024 (C=4 shards of 128·k tokens)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"ringtune CP attention benchmark: {args.tokens} tokens{' (--quick smoke run)' if args.quick else ''}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads here")
    results = []
    if 1 in args.figures:
        results += figures_memory_and_bytes(args.tokens, GQA_SHAPE)
    if 3 in args.figures:
        results += figure_load_balance(args.tokens)
    if 4 in args.figures:
        results += figure_speed(args.tokens, MHA_SHAPE, tuple(args.speed_cp), args.reps)
    print(f"\n{sum(results)}/{len(results)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
