"""Long rows under CP: per-rank peak memory at CP 1/2/4, a 131,072-token row at CP=4, and a packed row vs transformers.

Run ``python benchmarks/long_rows_cp.py [--tokens 8192 16384 32768] [--long-tokens 131072] [--quick]``. One run
prints, on :data:`long_rows.MODEL` (hidden 256, 4 layers: 3 GatedDeltaNet + 1 attention, vocab 32K, float32):

A. the per-rank peak of a training step (forward, backward, AdamW; recompute full; loss ``-Σ logprobs`` with the
   head's one-pass gradients, as the Trainer runs cross_entropy) at CP = 1, 2, 4 and each length, in a fresh
   process group each: peak live tensor bytes (torch.profiler) and VmHWM - VmRSS, max over ranks; the slope per
   1K tokens of the row at each CP, and the checks slope CP2 / CP1 <= 0.55 and peak CP4 / CP1 <= 0.30 at the
   longest row (a per-rank constant that does not shrink with CP shows in both);
B. one 131,072-token row at CP = 4, recompute full, trained forward + backward + AdamW step, per-rank peak
   (it needs several GiB across the 4 ranks: MemAvailable is printed first);
C. step time (forward, backward, AdamW) at CP = 1 on one packed row of 64 × 256-token sequences (16K tokens):
   ringtune (one packed forward, recompute none) vs transformers (the same weights, saved by transformers and
   loaded by ringtune; one sequence per forward, gradients accumulated, then one AdamW step), interleaved rounds
   after two warm-up steps each, median; goal ringtune / transformers <= 0.8. The summed losses of both are
   printed (same weights, same sum). Freed memory stays in the process for figure C (:func:`retain_freed_memory`),
   as a GPU caching allocator keeps it: glibc hands blocks over 32 MiB back to the kernel on free, and on this VM
   faulting them in again cost ~2.4 us per 4 KiB page, which made the first steps 1.5-2x slower and the timings
   a measure of page faults (both sides gain from it: transformers 31 -> 24 s, ringtune 33 -> 21 s).
   ``--glibc-default`` times it as the service runs (freed memory returned to the OS), ``--threads`` sets torch's
   threads (1 by default); issue 31's packed 8K row is ``--figures C --seqs 12 --seq-len 682 --threads 2``.
   The ratio of each round is printed with the median's, and their minimum. ``--before`` adds a third
   contender in the same rounds: ringtune as it was before issue 31's fixes of this step (the head's tile not
   aligned to ``TILE_TOKEN_ALIGN``, SwiGLU's activation by plain autograd), so one run shows before and after.

Ratios only: the machine is shared, absolute numbers are noise. See docs/memory.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from attention_cp import MIB, verdict
from long_rows import MODEL, describe_model, step_memory_worker

from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.logprob_tiles import tile_shape
from ringtune.models.shard import shard_of
from ringtune.parallel import spawn

SLOPE_GOAL = 0.55
PEAK_GOAL = 0.30
SPEED_GOAL = 0.8


def _max(runs: list[dict[str, Any]], key: str) -> float:
    return max(r[key] for r in runs)


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def gdn_mode(cp: int) -> str:
    """headwise where :data:`MODEL`'s key heads split over ``cp`` ranks, else chunkwise (CP=4: 2 key heads)."""
    return "headwise" if MODEL["linear_num_key_heads"] % cp == 0 else "chunkwise"


def tile_mib(local_tokens: int) -> float:
    """MiB of the head's float32 logits tile on a rank of ``local_tokens`` tokens of :data:`MODEL`."""
    vocab, dim = MODEL["vocab_size"], MODEL["hidden_size"]
    plan = tile_shape(local_tokens, vocab, dim, acc_bytes=4, weight_bytes=4)
    return min(plan.tokens, local_tokens) * plan.vocab * 4 / MIB


def figure_cp_memory(tokens_list: list[int], cps: list[int]) -> list[bool]:
    print("\n[A] per-rank peak of a training step, recompute full, one sequence, one-pass head; MiB, max over ranks")
    print("    (tile = the head's logits tile at that shard, models/logprob_tiles.py; 1 thread per rank; GDN headwise,")
    print("    chunkwise where the 2 key heads do not split: CP=4)")
    print(f"    {'CP':>3} {'tokens':>7} {'local':>6} {'tile':>6} {'tensor':>8} {'RSS':>8} {'act':>7} {'s':>6}")
    runs = {}
    for cp in cps:
        for tokens in tokens_list:
            res = spawn(step_memory_worker, cp, tokens, "full", True, gdn_mode(cp), threads=1)
            runs[cp, tokens] = res
            print(
                f"    {cp:>3} {tokens:>7} {res[0]['local_len']:>6} {tile_mib(res[0]['local_len']):6.1f} "
                f"{_max(res, 'tensor_peak_bytes') / MIB:8.1f} "
                f"{_max(res, 'rss_peak_bytes') / MIB:8.1f} {_max(res, 'activation_bytes') / MIB:7.1f} "
                f"{_max(res, 'seconds'):6.1f}",
                flush=True,
            )
    lo, hi = min(tokens_list), max(tokens_list)
    slopes: dict[tuple[int, str], float] = {}
    for cp in cps:
        for key, label in (("tensor_peak_bytes", "tensor"), ("rss_peak_bytes", "RSS")):
            rise = _max(runs[cp, hi], key) - _max(runs[cp, lo], key)
            slopes[cp, label] = rise / ((hi - lo) / 1024)
        print(
            f"    CP={cp}: slope per 1K tokens of the row ({lo}..{hi}): tensor {slopes[cp, 'tensor'] / MIB:6.2f} MiB, "
            f"RSS {slopes[cp, 'RSS'] / MIB:6.2f} MiB"
        )
    ok: list[bool] = []
    if 1 not in cps:
        print("    (no CP=1 in --cps: no ratios)")
        return ok
    for cp in [c for c in cps if c > 1]:
        for label in ("tensor", "RSS"):
            ratio = slopes[cp, label] / slopes[1, label]
            peak = _max(runs[cp, hi], f"{label.lower()}_peak_bytes" if label == "RSS" else "tensor_peak_bytes")
            peak_ratio = peak / _max(runs[1, hi], "rss_peak_bytes" if label == "RSS" else "tensor_peak_bytes")
            checks = []
            if cp == 2:
                checks.append(f"slope CP2/CP1 {ratio:.3f} (goal <= {SLOPE_GOAL}) {verdict(ratio, SLOPE_GOAL)}")
                if label == "tensor":
                    ok.append(ratio <= SLOPE_GOAL)
            else:
                checks.append(f"slope CP{cp}/CP1 {ratio:.3f} (info, ideal {1 / cp:.2f})")
            if cp == 4:
                checks.append(
                    f"peak CP4/CP1 at {hi} {peak_ratio:.3f} (goal <= {PEAK_GOAL}) {verdict(peak_ratio, PEAK_GOAL)}"
                )
                if label == "tensor":
                    ok.append(peak_ratio <= PEAK_GOAL)
            else:
                checks.append(f"peak CP{cp}/CP1 at {hi} {peak_ratio:.3f} (info)")
            print(f"    {label:<6} " + "; ".join(checks))
    return ok


def figure_long_row(tokens: int, cp: int) -> list[bool]:
    print(f"\n[B] one {tokens}-token row at CP={cp} (GDN {gdn_mode(cp)}), recompute full, forward + backward + AdamW")
    print(f"    MemAvailable before: {mem_available_gib():.1f} GiB")
    try:
        res = spawn(step_memory_worker, cp, tokens, "full", True, gdn_mode(cp), threads=1)
    except RuntimeError as exc:
        print(f"    FAILED: {str(exc).strip().splitlines()[-1]}")
        return [False]
    for rank, r in enumerate(res):
        print(
            f"    rank {rank}: {r['local_len']} tokens, peak tensor {r['tensor_peak_bytes'] / MIB:8.1f} MiB, "
            f"RSS {r['rss_peak_bytes'] / MIB:8.1f} MiB, activations {r['activation_bytes'] / MIB:7.1f} MiB, "
            f"{r['seconds']:.0f} s"
        )
    print(f"    trained: PASS (per-rank peak tensor {_max(res, 'tensor_peak_bytes') / 2**30:.2f} GiB)")
    return [True]


# ---------------------------------------------------------------- C: ringtune vs transformers


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory in the heap (no mmap'd blocks, no trimming); False where it is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def hf_and_ringtune(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' Qwen3.5 of :data:`MODEL` (sdpa attention) and ringtune's model loaded from its checkpoint."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{k: v for k, v in MODEL.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    hf = transformers.Qwen3_5ForCausalLM(config).float()
    with tempfile.TemporaryDirectory() as root:
        hf.save_pretrained(root)
        ours = load_hf(root, dtype=torch.float32)
    return hf, ours


@contextmanager
def as_before_issue_31() -> Iterator[None]:
    """ringtune's step as before issue 31's fixes: tiles of the budget's own token count, plain SiLU · up."""
    from ringtune.models import logprob_tiles
    from ringtune.models.layers import mlp, moe, silu_mul

    saved = logprob_tiles.TILE_TOKEN_ALIGN, mlp.silu_mul, moe.silu_mul
    logprob_tiles.TILE_TOKEN_ALIGN = 1
    mlp.silu_mul = moe.silu_mul = silu_mul.reference_silu_mul
    try:
        yield
    finally:
        logprob_tiles.TILE_TOKEN_ALIGN, mlp.silu_mul, moe.silu_mul = saved


def figure_vs_transformers(
    num_seqs: int, seq_len: int, rounds: int, threads: int = 1, retain: bool = True, before: bool = False
) -> list[bool]:
    torch.set_num_threads(threads)  # 1 by default: on a shared, loaded 2-core box OpenMP spin-waits time the neighbours
    retained = retain and retain_freed_memory()
    print(f"\n[C] step time at CP=1 on a packed row of {num_seqs} x {seq_len} tokens: ringtune (one packed forward,")
    print(
        f"    recompute none, one-pass head) vs transformers (one sequence per forward); {rounds} interleaved rounds,"
    )
    released = "returned to the OS (no glibc)" if retain else "returned to the OS (glibc default, as the service runs)"
    print(f"    {threads} thread(s); freed memory {'retained (mallopt)' if retained else released}")
    hf, ours = hf_and_ringtune()
    gen = torch.Generator().manual_seed(1)
    lens = [seq_len] * num_seqs
    ids = torch.randint(0, MODEL["vocab_size"], (num_seqs, seq_len), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((num_seqs, 1), -100)], dim=1)
    shard = shard_of(lens)  # CP = 1: the local order is the row order
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-6)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-6)

    def step_ours() -> float:
        flat = labels.reshape(-1)
        upstream = torch.where(flat != -100, -1.0, 0.0)
        loss = -ours(ids.reshape(-1), shard, flat, upstream).sum()
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return float(loss.detach())

    def step_hf() -> float:
        total = 0.0
        for i in range(num_seqs):
            logits = hf(input_ids=ids[i : i + 1]).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float(), ids[i, 1:], reduction="sum")
            loss.backward()
            total += float(loss.detach())
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return total

    def step_before() -> float:
        with as_before_issue_31():
            return step_ours()

    contenders = [("ringtune", step_ours), ("transformers", step_hf)] + ([("before", step_before)] if before else [])
    losses = {name: fn() for name, fn in contenders}  # warm-up; same weights: same loss
    for _, fn in contenders:  # a second warm-up: the heap reaches its peak size
        fn()
    print(f"    summed loss, first step: ringtune {losses['ringtune']:.4f}, transformers {losses['transformers']:.4f}")
    times: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for _ in range(rounds):
        for name, fn in contenders:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["ringtune"] / med["transformers"]
    per_round = [a / b for a, b in zip(times["ringtune"], times["transformers"], strict=True)]
    print(f"    ratio per round {' '.join(f'{r:.3f}' for r in per_round)}: min {min(per_round):.3f}")
    print(
        f"    median step: ringtune {med['ringtune']:.2f} s, transformers {med['transformers']:.2f} s "
        f"({torch.get_num_threads()} threads); ratio {ratio:.3f} (goal <= {SPEED_GOAL}) {verdict(ratio, SPEED_GOAL)}"
    )
    if before:
        was = [b / t for b, t in zip(times["before"], times["transformers"], strict=True)]
        print(
            f"    before issue 31's fixes (unaligned tile, plain SwiGLU activation): median {med['before']:.2f} s, "
            f"ratio {med['before'] / med['transformers']:.3f} (per round min {min(was):.3f}); "
            f"after / before {med['ringtune'] / med['before']:.3f}"
        )
    return [ratio <= SPEED_GOAL]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768], help="figure A row lengths")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="figure A CP sizes (1 first)")
    p.add_argument("--long-tokens", type=int, default=131072, help="figure B row length (0: skip)")
    p.add_argument("--long-cp", type=int, default=4)
    p.add_argument("--seqs", type=int, default=64, help="figure C sequences of --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="figure C torch threads (issue 31's 8K row: 2)")
    p.add_argument(
        "--glibc-default", action="store_true", help="figure C: freed memory goes back to the OS, as in the service"
    )
    p.add_argument("--before", action="store_true", help="figure C: also time ringtune as before issue 31's fixes")
    p.add_argument("--figures", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C"])
    p.add_argument("--quick", action="store_true", help="smoke run: 1K-4K tokens, 8K long row, 8 x 128 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.long_tokens, args.seqs, args.seq_len, args.rounds = [1024, 2048, 4096], 8192, 8, 128, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"ringtune long rows under CP{' (--quick smoke run)' if args.quick else ''}: torch {torch.__version__}")
    print(f"model: {describe_model()}")
    results: list[bool] = []
    if "A" in args.figures:
        results += figure_cp_memory(sorted(args.tokens), args.cps)
    if "B" in args.figures and args.long_tokens:
        results += figure_long_row(args.long_tokens, args.long_cp)
    if "C" in args.figures:
        results += figure_vs_transformers(
            args.seqs, args.seq_len, args.rounds, args.threads, not args.glibc_default, args.before
        )
    print(f"\n{sum(results)}/{len(results)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
