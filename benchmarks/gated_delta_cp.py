"""Context-parallel GatedDeltaNet on CPU/gloo: bytes each rank sends and per-rank peak memory, against goals.

Run ``python benchmarks/gated_delta_cp.py [--tokens 16384] [--heads-scale 4] [--quick]``. Every figure is
measured inside this one run (the machine is shared, so absolute timings are noise); each check prints the
value, the goal and PASS/FAIL. See benchmarks/README.md and docs/gated_delta.md for what each figure means.

1. bytes each rank sends per GDN layer, forward and backward, headwise vs chunkwise vs the "full all-gather"
   alternative (every rank all-gathers the whole q/k/v/g/beta stream), at the Qwen3.5-4B GDN head shapes, from
   a shape model that is first checked byte for byte against ringtune's collectives (``measure_comm``) on a
   cheap head shape (bytes depend on shapes only, never on values);
2. peak memory per rank of the GDN core forward+backward, C=4 over C=1, both modes (fresh processes each),
   at the 4B head shapes divided by ``--heads-scale``; the bytes of these runs are checked against the model.

Workers run in processes started by :func:`ringtune.parallel.spawn`, so they live at module level. The memory
helpers are those of ``attention_cp.py`` (same directory; imported, not copied).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from attention_cp import MIB, _proc_status_kib, _quiet_stderr, reset_peak_rss, verdict

from ringtune.layout.contiguous import relayout_plan
from ringtune.layout.zigzag import ZigzagPlan, zigzag_plan
from ringtune.ops.gated_delta.cp import gdn_cp_fn
from ringtune.ops.gated_delta.inputs import compute_dtype
from ringtune.parallel import all_gather, measure_comm, spawn

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import tensor_peak_bytes

QUICK_TOKENS = 4096
MMAP_THRESHOLD = 4 * 1024 * 1024
"""glibc malloc threshold above which a block is mmapped (and unmapped at free) in the memory workers."""
MODES = ("headwise", "chunkwise")
ALL_GATHER = "all-gather"
"""The alternative both modes are compared with: all-gather q/k/v/g/beta of the whole row to every rank."""
FLA_CP = "fla_cp"
"""fla's context parallelism (CUDA, or Triton's interpreter): modelled here, measured by ``gated_delta_fla_cp.py``."""


@dataclass(frozen=True, kw_only=True)
class GDNShape:
    """Head counts and dims of one GatedDeltaNet layer (conv kernel ``kernel``); one float dtype throughout."""

    hk: int
    hv: int
    dk: int
    dv: int
    kernel: int = 4

    @property
    def conv_channels(self) -> int:
        """Channels of the short conv: ``[q | k | v]`` = 2·Hk·Dk + Hv·Dv."""
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def row_width(self) -> int:
        """Values per token of the layer's input stream q/k/v/g/beta: conv channels + 2·Hv."""
        return self.conv_channels + 2 * self.hv

    def describe(self) -> str:
        return f"Hk={self.hk} Hv={self.hv} Dk={self.dk} Dv={self.dv} conv K={self.kernel}"


QWEN35_4B = GDNShape(hk=16, hv=32, dk=128, dv=128)  # Qwen3.5-4B linear-attention (GDN) layers
BYTES_SHAPE = GDNShape(hk=4, hv=8, dk=16, dv=8)
"""Cheap shape the byte model is checked on: every term differs (Hk != Hv, Dk != Dv), C=4 | Hk and Hv."""


def scaled_shape(heads_scale: int) -> GDNShape:
    """:data:`QWEN35_4B` with both head counts divided by ``heads_scale`` (head dims kept)."""
    return replace(QWEN35_4B, hk=QWEN35_4B.hk // heads_scale, hv=QWEN35_4B.hv // heads_scale)


# ---------------------------------------------------------------- the byte model


def model_bytes(mode: str, plan: ZigzagPlan, shape: GDNShape, dtype: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes rank ``plan.cp_rank`` sends in one GDN core layer under CP ``mode``.

    Counted as :mod:`ringtune.parallel.meter` counts them (bytes this rank puts on the wire, blocks for itself
    excluded), with the stream in ``dtype`` and the chunkwise state summaries in its compute dtype. ``mode``:

    - ``headwise``: all-to-all of q/k/v/g/beta to head shards and of the output back, (C-1)/C of each;
      backward is the same two all-to-alls reversed;
    - ``chunkwise``: the zigzag -> contiguous all-to-all of q/k/v/g/beta and back for the output (the tokens
      this rank keeps do not move), the K-1 row conv halo (ring shift) and the all-gather of this rank's
      ``[Hv, Dk, Dk+Dv]`` summary (M | h_local); backward: the same, reversed (reduce-scatter for the gather);
    - ``fla_cp``: chunkwise's relayouts and summary, with fla's exchanges (``ops/gated_delta/cp_fla.py``): the
      conv halo and its gradient by all-gather ((C-1)·(K-1) rows where the ring shift sends K-1; equal at C=2),
      the summaries by all-gather forward and backward;
    - ``all-gather``: all-gather of the q/k/v/g/beta stream, reduce-scatter of its gradient (no output moves).
    """
    size, n = plan.cp_size, plan.local_len
    if size == 1:
        return 0, 0
    item = torch.empty(0, dtype=dtype).element_size()
    out_width = shape.hv * shape.dv
    if mode == "headwise":
        one_way = (size - 1) * n * (shape.row_width // size + out_width // size) * item
    elif mode in ("chunkwise", FLA_CP):
        moved = n - relayout_plan(plan).send_counts[plan.cp_rank]
        acc_item = torch.empty(0, dtype=compute_dtype(dtype)).element_size()
        summary = shape.hv * shape.dk * (shape.dk + shape.dv) * acc_item
        halo = (shape.kernel - 1) * shape.conv_channels * item * (size - 1 if mode == FLA_CP else 1)
        one_way = moved * (shape.row_width + out_width) * item + halo + (size - 1) * summary
    elif mode == ALL_GATHER:
        one_way = (size - 1) * n * shape.row_width * item
    else:
        raise ValueError(f"mode must be one of {(*MODES, FLA_CP, ALL_GATHER)}, got {mode!r}")
    return one_way, one_way


def model_all_ranks(mode: str, tokens: int, cp: int, shape: GDNShape, dtype: torch.dtype) -> list[tuple[int, int]]:
    """:func:`model_bytes` of every rank of a row of one ``tokens``-long sequence at CP ``cp``."""
    return [model_bytes(mode, zigzag_plan([tokens], cp_size=cp, cp_rank=r), shape, dtype) for r in range(cp)]


# ---------------------------------------------------------------- workers


def _random_inputs(plan: ZigzagPlan, shape: GDNShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """This rank's zigzag shard of raw q, k, v, gates g (< 0), beta (in (0, 1)) and a replicated conv weight.

    float32 leaves that require grad, plus ``dout`` (no grad), the output gradient.
    """
    n = plan.local_len
    x = {
        "q": torch.randn(n, shape.hk, shape.dk, generator=gen),
        "k": torch.randn(n, shape.hk, shape.dk, generator=gen),
        "v": torch.randn(n, shape.hv, shape.dv, generator=gen),
        "g": -torch.rand(n, shape.hv, generator=gen),
        "beta": torch.rand(n, shape.hv, generator=gen),
        "conv_weight": torch.randn(shape.conv_channels, shape.kernel, generator=gen) * 0.5,
    }
    for t in x.values():
        t.requires_grad_()
    x["dout"] = torch.randn(n, shape.hv, shape.dv, generator=gen)
    return x


def _run_layer(mode: str, x: dict[str, torch.Tensor], plan: ZigzagPlan, group: dist.ProcessGroup) -> tuple[int, int]:
    """Forward and backward of one GDN core layer under ``mode`` (or the all-gather); bytes sent by each."""
    if mode == ALL_GATHER:
        stream = torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1), x["g"], x["beta"]], dim=1)
        with measure_comm() as fwd:
            full = all_gather(stream, group)
        with measure_comm() as bwd:
            full.backward(torch.ones_like(full))
        return fwd.bytes_sent, bwd.bytes_sent
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["conv_weight"], plan, group)
    with measure_comm() as fwd:
        out = gdn_cp_fn(mode)(*args)
    with measure_comm() as bwd:
        out.backward(x["dout"])
    return fwd.bytes_sent, bwd.bytes_sent


def bytes_worker(rank: int, tokens_list: list[int], shape: GDNShape) -> dict[tuple[int, str], tuple[int, int]]:
    """Bytes this rank sends (forward, backward) per (tokens, mode), one sequence, float32, world = CP group."""
    group = dist.group.WORLD
    cp = dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    sent = {}
    for tokens in tokens_list:
        plan = zigzag_plan([tokens], cp_size=cp, cp_rank=rank)
        for mode in (*MODES, ALL_GATHER):
            sent[tokens, mode] = _run_layer(mode, _random_inputs(plan, shape, gen), plan, group)
    return sent


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> None:
    """Make glibc mmap every block of ``nbytes`` or more, so that RSS follows the live tensors.

    glibc's default threshold is dynamic: it rises to the size of each freed mmapped block, up to 32 MiB, after
    which blocks below it are carved from the heap and, freed, stay resident. The chunk scan allocates and frees
    many such blocks, and RSS then reads several times the live tensor bytes (measured: 4.8 GiB RSS for 0.54 GiB
    of tensors at 4K tokens under the profiler). A fixed threshold also turns off that dynamic adjustment.
    """
    M_MMAP_THRESHOLD = -3  # <malloc.h>
    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes):
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) failed")


def memory_worker(rank: int, mode: str, tokens: int, shape: GDNShape) -> dict[str, Any]:
    """Peak memory and bytes sent of one forward+backward of GDN CP ``mode`` on one ``tokens``-long sequence.

    Runs on every rank of a fresh process group of size C (the world), with :func:`fix_mmap_threshold`. A tiny
    forward+backward first warms up the kernels, thread pools and gloo connections; then the RSS high-water
    mark is reset, the RSS read (the baseline), this rank's shard of q, k, v, g, beta, dout and the conv weight
    are created (these count) and forward+backward run; peak = VmHWM - baseline.
    """
    fix_mmap_threshold()
    group = dist.group.WORLD
    cp = dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + rank)
    warm = zigzag_plan([2 * cp * 64], cp_size=cp, cp_rank=rank)
    _run_layer(mode, _random_inputs(warm, shape, gen), warm, group)
    gc.collect()
    dist.barrier()

    plan = zigzag_plan([tokens], cp_size=cp, cp_rank=rank)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    reset_peak_rss()
    base_kib = _proc_status_kib("VmRSS")
    x = _random_inputs(plan, shape, gen)
    input_bytes = sum(t.numel() * t.element_size() for t in x.values())
    t0 = time.perf_counter()
    fwd_sent, bwd_sent = _run_layer(mode, x, plan, group)
    seconds = time.perf_counter() - t0
    peak_kib = _proc_status_kib("VmHWM")
    with _quiet_stderr():
        prof.stop()
    return {
        "rss_peak_bytes": (peak_kib - base_kib) * 1024,
        "tensor_peak_bytes": tensor_peak_bytes(prof),
        "input_bytes": input_bytes,
        "sent": (fwd_sent, bwd_sent),
        "local_len": plan.local_len,
        "seconds": seconds,
    }


# ---------------------------------------------------------------- figure 1: bytes


def pass_fail(ok: bool) -> str:
    """'PASS' or 'FAIL' for an exact (yes/no) check."""
    return "PASS" if ok else "FAIL"


def _ratio_text(value: float, base: float) -> str:
    return f"{value / base:6.3f}" if base else "     -"


def figure_bytes(model_tokens: list[int], measure_tokens: list[int], cps: list[int]) -> list[bool]:
    dtype = torch.float32
    print("\n[1] bytes each rank sends per GatedDeltaNet layer core (conv, q/k norm, delta rule), one sequence")
    print("    bytes depend on shapes only (tokens, C, head counts and dims, dtype), never on values: the shape")
    print("    model (model_bytes, docs/gated_delta.md) is checked byte for byte against measure_comm on a cheap")
    print(f"    shape, {BYTES_SHAPE.describe()}, at {', '.join(map(str, measure_tokens))} tokens (the delta rule's")
    print("    CPU backward is too slow for 64K here), then evaluated at the Qwen3.5-4B shape")
    ok = []
    for cp in cps:
        t0 = time.perf_counter()
        measured = spawn(bytes_worker, cp, measure_tokens, BYTES_SHAPE)
        exact = all(
            measured[r][tokens, mode] == model_all_ranks(mode, tokens, cp, BYTES_SHAPE, dtype)[r]
            for tokens in measure_tokens
            for mode in (*MODES, ALL_GATHER)
            for r in range(cp)
        )
        ok.append(exact)
        last = measure_tokens[-1]
        sample = ", ".join(
            f"{mode} {max(measured[r][last, mode][0] for r in range(cp)) / MIB:.2f}" for mode in (*MODES, ALL_GATHER)
        )
        print(
            f"    C={cp} measured == model, every rank, mode, direction, token count   goal exact   {pass_fail(exact)}"
            f"   ({last} tokens fwd MiB max: {sample}; {time.perf_counter() - t0:.0f} s)"
        )
    print(f"    Qwen3.5-4B {QWEN35_4B.describe()}, float32 stream and summaries; model; MiB; max and mean over ranks")
    print(
        f"    {'tokens':>6} {'C':>2} {'mode':<10} {'fwd max':>8} {'bwd max':>8} {'fwd+bwd mean':>12}"
        f"  {'/headwise max|mean':>18}  {'/all-gather max|mean':>20}"
    )
    for tokens in model_tokens:
        for cp in cps:
            per_mode = {m: model_all_ranks(m, tokens, cp, QWEN35_4B, dtype) for m in (*MODES, ALL_GATHER)}
            stats = {
                m: (max(f + b for f, b in r), sum(f + b for f, b in r) / cp, max(f for f, _ in r), max(b for _, b in r))
                for m, r in per_mode.items()
            }
            hw, ag = stats["headwise"], stats[ALL_GATHER]
            for mode, (tot_max, tot_mean, f_max, b_max) in stats.items():
                print(
                    f"    {tokens:>6} {cp:>2} {mode:<10} {f_max / MIB:8.1f} {b_max / MIB:8.1f} {tot_mean / MIB:12.1f}"
                    f"  {_ratio_text(tot_max, hw[0]):>9} | {_ratio_text(tot_mean, hw[1])}"
                    f"  {_ratio_text(tot_max, ag[0]):>11} | {_ratio_text(tot_mean, ag[1])}"
                )
    return ok


# ---------------------------------------------------------------- figure 2: memory


def figure_memory(tokens: int, shape: GDNShape) -> list[bool]:
    cp = 4
    print(f"\n[2] peak memory per rank of the GDN core forward+backward, one {tokens}-token sequence, float32,")
    print(f"    {shape.describe()} (Qwen3.5-4B heads / {QWEN35_4B.hk // shape.hk}); fresh processes per configuration;")
    print("    inputs (this rank's q, k, v, g, beta, dout, conv weight) count. tensor = peak live CPU tensor bytes")
    print("    (torch.profiler memory events); RSS = VmHWM - VmRSS before the inputs (glibc malloc, blocks of 4 MiB")
    print("    or more mmapped: see fix_mmap_threshold)")
    runs = {}
    for mode in MODES:
        for size in (1, cp):
            runs[mode, size] = spawn(memory_worker, size, mode, tokens, shape)
    print(f"    {'config':<16} {'tensor MiB':>10} {'RSS MiB':>9}  {'inputs MiB':>10}  seconds   (max over ranks)")
    for (mode, size), res in runs.items():
        print(
            f"    {mode + ' C=' + str(size):<16} {max(r['tensor_peak_bytes'] for r in res) / MIB:10.1f} "
            f"{max(r['rss_peak_bytes'] for r in res) / MIB:9.1f}  {res[0]['input_bytes'] / MIB:10.1f}  "
            f"{max(r['seconds'] for r in res):7.1f}   per rank tensor "
            + " ".join(f"{r['tensor_peak_bytes'] / MIB:.0f}" for r in res)
        )
    # Goal 0.35: the ideal 1/C = 0.25 plus a margin for what does not divide by C. Per-rank constants: the
    # gathered summaries [C, Hv, Dk, Dk+Dv] (M | h_local) and the folded state [Hv, Dk, Dv], the K-1 row conv
    # halo; besides, each mode holds its all-to-all send and receive buffers (a few
    # [T_local, row_width] copies). Attention's goal is 0.30. Not in that margin: chunkwise's affine summary is
    # a second chunk scan over the part's last segment (values [v | 0], Dv + Dk wide, one [Hv, Dk, Dk+Dv]
    # state per chunk) whose tensors autograd keeps beside the core's until backward. That is per local token,
    # not constant; ranks 0..C-2 pay it, rank C-1 (no successor: it computes none) does not (per-rank column).
    ok = []
    for label, key in (("tensor", "tensor_peak_bytes"), ("RSS", "rss_peak_bytes")):
        for mode in MODES:
            ratio = max(r[key] for r in runs[mode, cp]) / max(r[key] for r in runs[mode, 1])
            ok.append(ratio <= 0.35)
            print(
                f"    {mode:<9} C={cp} / C=1 ({label:<6}) {ratio:.3f}   goal <= 0.35   {verdict(ratio, 0.35)}"
                f"   (ideal 1/C = 0.25; attention's goal 0.30)"
            )
    chunk = [r["tensor_peak_bytes"] for r in runs["chunkwise", cp]]
    base = max(r["tensor_peak_bytes"] for r in runs["chunkwise", 1])
    print(
        f"    info: chunkwise rank C-1 (no summary) {chunk[-1] / base:.3f} of C=1; the summary scan adds "
        f"{(max(chunk[:-1]) - chunk[-1]) / MIB:.0f} MiB on ranks 0..C-2 (its scan is recomputed in backward)"
    )
    exact = all(
        runs[mode, cp][r]["sent"] == model_all_ranks(mode, tokens, cp, shape, torch.float32)[r]
        for mode in MODES
        for r in range(cp)
    )
    ok.append(exact)
    print(f"    bytes sent in these C={cp} runs == model on every rank   goal exact   {pass_fail(exact)}")
    return ok


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of figure 2's row (multiple of 1024)")
    parser.add_argument(
        "--heads-scale", type=int, default=4, help="divide the 4B head counts (16 k, 32 v) by this in figure 2"
    )
    parser.add_argument("--bytes-tokens", type=int, nargs="+", default=[16384, 65536], help="figure 1's table")
    parser.add_argument(
        "--measure-tokens", type=int, nargs="+", default=None, help="figure 1's measured check (4096 16384; quick 4096)"
    )
    parser.add_argument("--bytes-cp", type=int, nargs="+", default=[2, 4], help="CP sizes of figure 1")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_TOKENS} tokens measured")
    parser.add_argument("--figures", type=int, nargs="+", default=[1, 2], help="figures to run")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = QUICK_TOKENS
    if args.measure_tokens is None:
        args.measure_tokens = [QUICK_TOKENS] if args.quick else [QUICK_TOKENS, 16384]
    token_args = [("--tokens", args.tokens)]
    token_args += [("--bytes-tokens", t) for t in args.bytes_tokens]
    token_args += [("--measure-tokens", t) for t in args.measure_tokens]
    for name, value in token_args:
        if value < 1024 or value % 1024:
            parser.error(f"{name}={value} must be a positive multiple of 1024 (C=4 shards of 128·k tokens)")
    if args.heads_scale not in (1, 2, 4):
        parser.error(f"--heads-scale={args.heads_scale} must be 1, 2 or 4 (headwise C=4 needs 4 | Hk = 16 / scale)")
    bad_cp = [c for c in args.bytes_cp if c < 2 or BYTES_SHAPE.hk % c or BYTES_SHAPE.hv % c]
    if bad_cp:
        parser.error(f"--bytes-cp {bad_cp}: each must be >= 2 and divide Hk={BYTES_SHAPE.hk} and Hv={BYTES_SHAPE.hv}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"ringtune CP GatedDeltaNet benchmark{' (--quick smoke run)' if args.quick else ''}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads here")
    results = []
    if 1 in args.figures:
        results += figure_bytes(args.bytes_tokens, args.measure_tokens, args.bytes_cp)
    if 2 in args.figures:
        results += figure_memory(args.tokens, scaled_shape(args.heads_scale))
    print(f"\n{sum(results)}/{len(results)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
