"""Long rows at linear cost: GatedDeltaNet time per token, and a training step's memory with recomputation.

Run ``python benchmarks/long_rows.py [--tokens 2048 4096 8192 16384] [--memory-tokens 8192 16384] [--quick]``.
Every figure is a ratio measured inside this one run (the machine is shared: absolute timings are noise); each
check prints the value, the goal and PASS/FAIL. See benchmarks/README.md and docs/memory.md.

The model is Qwen3.5-shaped and small (:data:`MODEL`): hidden 256, 4 layers (3 GatedDeltaNet + 1 gated
attention), vocab 32K, float32, random weights.

1. forward+backward time per token of one GatedDeltaNet layer of that model on one sequence of 2K..16K tokens,
   at CP=1 and (``--cp2``, default on) at CP=2 in both GDN modes, over the time at the smallest length (goal:
   every ratio <= 1.3; before the per-step split of the chunk scan it was x3 at 16K, x6 on this shape);
   interleaved rounds, median of per-round max over ranks, one thread per rank;
2. per-rank peak memory of a full training step (forward, backward, AdamW step) of the model on one sequence
   at 8K and 16K tokens with recompute none / full / selective, in a fresh process each: peak live tensor bytes
   (torch.profiler memory events), VmHWM - VmRSS before the inputs, and the activations autograd keeps between
   forward and backward (live tensor bytes at the end of the forward, minus what existed before it). Goals:
   activations none / full >= 4; memory linear in tokens (the slope per 1K tokens is printed).

Workers run in processes started by :func:`ringtune.parallel.spawn`, so they live at module level.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from attention_cp import MIB, _proc_status_kib, _quiet_stderr, reset_peak_rss, verdict
from gated_delta_cp import fix_mmap_threshold

from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.models.recompute import RECOMPUTE_MODES, set_recompute
from ringtune.models.shard import shard_of
from ringtune.ops.cp_modes import GATED_DELTA_MODES
from ringtune.parallel import spawn

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import allocation_events

MODEL: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 32768,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
"""A small Qwen3.5-shaped HF text config (GDN heads 2 k / 4 v of 64; attention 4 q / 2 kv heads of 64)."""

TIME_GOAL = 1.3
ACTIVATION_GOAL = 4.0
MARKER_ELEMS = 123_457
"""A float64 tensor of this many elements marks the end of the forward in the profiler's allocation events."""


def build_model(seed: int = 0) -> CausalLM:
    """:data:`MODEL` with random float32 weights (torch's default init, seeded)."""
    torch.manual_seed(seed)
    return CausalLM(DecoderConfig.from_hf(MODEL))


def describe_model() -> str:
    m = MODEL
    return (
        f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers (3 GDN + 1 attention), vocab {m['vocab_size']}, "
        f"GDN {m['linear_num_key_heads']} k / {m['linear_num_value_heads']} v heads of {m['linear_key_head_dim']}, "
        f"attention {m['num_attention_heads']} / {m['num_key_value_heads']} heads of {m['head_dim']}, float32"
    )


# ---------------------------------------------------------------- figure 1: GDN time per token


def reuse_freed_memory(nbytes: int = 1 << 30) -> None:
    """Make glibc keep freed blocks below ``nbytes`` for reuse (no mmap / trim), as a caching allocator does.

    By default glibc mmaps every block above its dynamic threshold (at most 32 MiB) and unmaps it when freed, so
    each new allocation of that size is faulted in and zeroed by the kernel again. At 32K tokens the scan's
    [chunks, H, 64, 64] float32 tensors cross 32 MiB, and that page-fault cost alone made the layer's per-token
    time x1.4 of 8K's (measured: x1.17 with this setting, and 3x faster overall); it is the allocator's, not the
    algorithm's (GPU caching allocators reuse blocks).
    """
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    if not (libc.mallopt(M_MMAP_THRESHOLD, nbytes) and libc.mallopt(M_TRIM_THRESHOLD, nbytes)):
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD, {nbytes}) failed")


def gdn_time_worker(rank: int, tokens_list: list[int], modes: list[str], rounds: int) -> dict[tuple[str, int], list]:
    """Seconds of forward+backward of the model's first GDN layer per (mode, tokens), one per round (world = CP).

    Runs with :func:`reuse_freed_memory`.
    """
    reuse_freed_memory()
    group = dist.group.WORLD
    cp = dist.get_world_size()
    layer = build_model().model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(rank)
    times: dict[tuple[str, int], list] = {}

    def once(mode: str, tokens: int) -> float:
        shard = shard_of([tokens], cp_size=cp, cp_rank=rank, group=group if cp > 1 else None, gated_delta=mode)
        x = torch.randn(shard.plan.local_len, MODEL["hidden_size"], generator=gen).requires_grad_()
        dout = torch.randn(x.shape, generator=gen)
        dist.barrier()
        start = time.perf_counter()
        layer(x, shard).backward(dout)
        elapsed = time.perf_counter() - start
        layer.zero_grad(set_to_none=True)
        return elapsed

    for mode in modes:
        once(mode, min(tokens_list))  # warm-up: kernels, thread pools, gloo connections
    for _ in range(rounds):
        for tokens in tokens_list:
            for mode in modes:
                times.setdefault((mode, tokens), []).append(once(mode, tokens))
    return times


def figure_gdn_time(tokens_list: list[int], rounds: int, cp2: bool) -> list[bool]:
    print(f"\n[1] GatedDeltaNet layer forward+backward time per token, one sequence, {rounds} interleaved rounds,")
    print("    median of per-round max over ranks, 1 thread per rank, freed memory reused (glibc mallopt, see")
    print("    reuse_freed_memory); ratio to the shortest row (goal <= 1.3)")
    configs = [(1, ["headwise"])] + ([(2, list(GATED_DELTA_MODES))] if cp2 else [])
    ok = []
    for cp, modes in configs:
        per_rank = spawn(gdn_time_worker, cp, tokens_list, modes, rounds, threads=1)
        for mode in modes:
            label = "CP=1" if cp == 1 else f"CP={cp} {mode}"
            per_token = {}
            for tokens in tokens_list:
                rounds_max = [max(r[mode, tokens][i] for r in per_rank) for i in range(rounds)]
                per_token[tokens] = statistics.median(rounds_max) / tokens
            base = per_token[tokens_list[0]]
            cells = "  ".join(
                f"{t // 1024}K {per_token[t] * 1e6:6.1f} us x{per_token[t] / base:.2f}" for t in tokens_list
            )
            worst = max(per_token[t] / base for t in tokens_list)
            ok.append(worst <= TIME_GOAL)
            best = {t: min(max(r[mode, t][i] for r in per_rank) for i in range(rounds)) / t for t in tokens_list}
            best_worst = max(best[t] / best[tokens_list[0]] for t in tokens_list)
            print(
                f"    {label:<16} {cells}   max ratio {worst:.2f}  {verdict(worst, TIME_GOAL)}"
                f"   (fastest rounds: max ratio {best_worst:.2f})"
            )
    return ok


# ---------------------------------------------------------------- figure 2: step memory


def step_memory_worker(
    rank: int, tokens: int, recompute: str, one_pass: bool = True, gated_delta: str = "headwise"
) -> dict[str, Any]:
    """Peak memory of one training step (forward, backward, AdamW step) of :data:`MODEL` on one ``tokens`` sequence.

    The loss is ``-Σ logprobs`` (cross_entropy with weights 1); with ``one_pass`` its gradient (-1 per token) is
    handed to the head, which then makes its gradients in its forward tile pass, as the Trainer does.
    ``gated_delta``: the GDN CP mode (headwise needs the key heads divisible by CP).

    A warm-up step on 256 tokens first creates the AdamW moments and the gradients' first use (kernels, thread
    pools); gradients are then dropped. Measured from there: peak live tensor bytes over the step, VmHWM - VmRSS
    before the inputs, and the activations (live bytes at the end of the forward, found by a marker allocation).
    """
    fix_mmap_threshold()
    group = dist.group.WORLD
    cp = dist.get_world_size()
    model = build_model()
    set_recompute(model, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(n: int, marker: bool = False) -> torch.Tensor | None:
        shard = shard_of([n], cp_size=cp, cp_rank=rank, group=group if cp > 1 else None, gated_delta=gated_delta)
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(0, MODEL["vocab_size"], (shard.plan.local_len,), generator=gen)
        labels = torch.randint(0, MODEL["vocab_size"], (shard.plan.local_len,), generator=gen)
        upstream = torch.full(labels.shape, -1.0) if one_pass else None
        loss = -model(ids, shard, labels, upstream).sum()
        mark = torch.empty(MARKER_ELEMS, dtype=torch.float64) if marker else None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return mark

    step(256)
    gc.collect()
    dist.barrier()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    reset_peak_rss()
    base_kib = _proc_status_kib("VmRSS")
    start = time.perf_counter()
    step(tokens, marker=True)
    seconds = time.perf_counter() - start
    peak_kib = _proc_status_kib("VmHWM")
    with _quiet_stderr():
        prof.stop()
    events = allocation_events(prof)
    marker_bytes = MARKER_ELEMS * 8
    at_marker = [total - size for _, size, total in events if size == marker_bytes]
    if len(at_marker) != 1:
        raise RuntimeError(f"expected one marker allocation of {marker_bytes} bytes; found {len(at_marker)}")
    return {
        "tensor_peak_bytes": max(total for _, _, total in events),
        "rss_peak_bytes": (peak_kib - base_kib) * 1024,
        "activation_bytes": at_marker[0],
        "seconds": seconds,
        "local_len": shard_of([tokens], cp_size=cp, cp_rank=rank, group=group if cp > 1 else None).plan.local_len,
    }


def figure_step_memory(tokens_list: list[int], modes: list[str], cp: int) -> list[bool]:
    print(f"\n[2] per-rank peak memory of a training step (forward, backward, AdamW), one sequence, CP={cp},")
    print("    fresh process per configuration (glibc: blocks >= 4 MiB mmapped). tensor = peak live CPU tensor")
    print("    bytes (torch.profiler); RSS = VmHWM - VmRSS before the step; activations = live tensor bytes at")
    print("    the end of the forward (what autograd keeps for the backward); MiB, max over ranks")
    runs = {(t, m): spawn(step_memory_worker, cp, t, m) for t in tokens_list for m in modes}
    print(
        f"    {'tokens':>6} {'recompute':<10} {'tensor':>8} {'RSS':>8} {'activations':>11} {'act KiB/tok':>11} {'s':>6}"
    )
    for (tokens, mode), res in runs.items():
        act = max(r["activation_bytes"] for r in res)
        print(
            f"    {tokens:>6} {mode:<10} {max(r['tensor_peak_bytes'] for r in res) / MIB:8.1f} "
            f"{max(r['rss_peak_bytes'] for r in res) / MIB:8.1f} {act / MIB:11.1f} "
            f"{act / res[0]['local_len'] / 1024:11.2f} {max(r['seconds'] for r in res):6.1f}"
        )
    ok = []
    lo, hi = min(tokens_list), max(tokens_list)
    for mode in modes:
        for key, label in (("tensor_peak_bytes", "tensor"), ("rss_peak_bytes", "RSS"), ("activation_bytes", "act")):
            slope = (max(r[key] for r in runs[hi, mode]) - max(r[key] for r in runs[lo, mode])) / ((hi - lo) / 1024)
            print(f"    slope {mode:<10} {label:<7} {slope / MIB:7.2f} MiB per 1K tokens ({lo}..{hi})")
    if "none" in modes:
        for tokens in tokens_list:
            none_act = max(r["activation_bytes"] for r in runs[tokens, "none"])
            none_peak = max(r["tensor_peak_bytes"] for r in runs[tokens, "none"])
            for mode in [m for m in modes if m != "none"]:
                ratio = none_act / max(r["activation_bytes"] for r in runs[tokens, mode])
                peak_ratio = none_peak / max(r["tensor_peak_bytes"] for r in runs[tokens, mode])
                check = mode == "full"
                if check:
                    ok.append(ratio >= ACTIVATION_GOAL)
                goal = f"goal >= {ACTIVATION_GOAL:.0f}  {'PASS' if ratio >= ACTIVATION_GOAL else 'FAIL'}"
                print(
                    f"    {tokens:>6} activations none / {mode:<9} {ratio:6.2f}   "
                    f"{goal if check else '(info)':<18} peak none / {mode} {peak_ratio:.2f}"
                )
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="figure 1 lengths")
    p.add_argument("--rounds", type=int, default=5, help="figure 1 interleaved rounds")
    p.add_argument("--no-cp2", action="store_true", help="figure 1 at CP=1 only")
    p.add_argument("--memory-tokens", type=int, nargs="+", default=[8192, 16384], help="figure 2 lengths")
    p.add_argument("--recompute", nargs="+", default=list(RECOMPUTE_MODES), choices=RECOMPUTE_MODES)
    p.add_argument("--memory-cp", type=int, default=1, help="figure 2 CP size")
    p.add_argument("--figures", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quick", action="store_true", help="smoke run: 1K-4K tokens, 1 round, CP=1")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds, args.no_cp2, args.memory_tokens = [1024, 2048, 4096], 1, True, [2048, 4096]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"ringtune long-row benchmark{' (--quick smoke run)' if args.quick else ''}: torch {torch.__version__}")
    print(f"model: {describe_model()}")
    results = []
    if 1 in args.figures:
        results += figure_gdn_time(sorted(args.tokens), args.rounds, not args.no_cp2)
    if 2 in args.figures:
        results += figure_step_memory(sorted(args.memory_tokens), args.recompute, args.memory_cp)
    print(f"\n{sum(results)}/{len(results)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
