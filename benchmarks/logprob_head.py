"""Peak memory of the tiled log-prob head, forward+backward, against the [T × V] logits it never builds.

Run ``python benchmarks/logprob_head.py [--tokens 32768] [--vocab 248320] [--hidden 64] [--quick]``.
The hidden size is small on purpose: the [T × V] buffer is what a plain head would add, and it does
not depend on D; a small D keeps the CPU time to a few minutes. One process, float32 throughout.

Printed (each a ratio measured in this run, with its goal and PASS/FAIL):
1. peak live tensor bytes (torch.profiler memory events) and RSS (VmHWM) of forward+backward;
2. that peak over the bytes of a full float32 [T, V] logits tensor (goal < 0.1);
3. the peak minus inputs and gradients, in tiles (goal <= 1.5: one logits tile plus per-token buffers);
4. a check that the measured log-probs equal the plain reference on a few tokens.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

# The memory probes of the attention benchmark (same directory, on sys.path when run as a script).
from attention_cp import _proc_status_kib, _quiet_stderr, reset_peak_rss, verdict

from ringtune.models.logprob_head import (
    DEFAULT_MAX_CHUNK_BYTES,
    label_logprobs,
    plan_tiles,
    reference_label_logprobs,
)

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import tensor_peak_bytes

MIB = 1024 * 1024
QWEN35_VOCAB = 248_320
QUICK_TOKENS = 4096


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def measure(tokens: int, vocab: int, hidden_size: int, max_chunk_bytes: int, seed: int = 0) -> dict[str, float]:
    """One forward+backward of :func:`label_logprobs` on random float32 inputs; peak bytes and seconds.

    A tiny forward+backward first warms up kernels and thread pools; then profiling starts, the RSS
    high-water mark is reset, and the inputs are created inside the measured region (they count, as do
    the gradient buffers autograd allocates); every label is scored (the most work).
    """
    gen = torch.Generator().manual_seed(seed)
    warm_h = torch.randn(8, hidden_size, requires_grad=True)
    warm_w = torch.randn(16, hidden_size, requires_grad=True)
    label_logprobs(warm_h, warm_w, torch.arange(8)).sum().backward()
    del warm_h, warm_w
    gc.collect()

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    reset_peak_rss()
    base_kib = _proc_status_kib("VmRSS")
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    grad_out = torch.randn(tokens, generator=gen)
    input_bytes = nbytes(hidden, weight, labels, grad_out)
    t0 = time.perf_counter()
    out = label_logprobs(hidden, weight, labels, max_chunk_bytes=max_chunk_bytes)
    t1 = time.perf_counter()
    out.backward(grad_out)
    t2 = time.perf_counter()
    peak_kib = _proc_status_kib("VmHWM")
    with _quiet_stderr():
        prof.stop()
    assert hidden.grad is not None and weight.grad is not None
    grad_bytes = nbytes(hidden.grad, weight.grad) + nbytes(out)

    probe = torch.linspace(0, tokens - 1, 8).long()
    with torch.no_grad():
        want = reference_label_logprobs(hidden[probe], weight, labels[probe])
    return {
        "tensor_peak": tensor_peak_bytes(prof),
        "rss_peak": (peak_kib - base_kib) * 1024,
        "inputs": input_bytes,
        "grads": grad_bytes,
        "forward_s": t1 - t0,
        "backward_s": t2 - t1,
        "probe_err": (out.detach()[probe] - want).abs().max().item(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=QWEN35_VOCAB)
    p.add_argument("--hidden", type=int, default=64, help="hidden size D (small: the [T x V] buffer is the point)")
    p.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_TOKENS} tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = QUICK_TOKENS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    T, V, D = args.tokens, args.vocab, args.hidden
    start = time.perf_counter()
    print(f"ringtune log-prob head benchmark{' (--quick smoke run)' if args.quick else ''}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    meta_h = torch.empty(T, D, device="meta")
    plan = plan_tiles(meta_h, torch.empty(V, D, device="meta"), max_chunk_bytes=args.max_chunk_bytes)
    tile_bytes = plan.tokens * plan.vocab * 4
    full_bytes = T * V * 4
    print(f"shapes: hidden [{T}, {D}] float32, weight [{V}, {D}] float32, labels [{T}] int64 (all scored)")
    print(
        f"tiles:  {plan.tokens} tokens x {plan.vocab} vocab = {tile_bytes / MIB:.1f} MiB "
        f"(budget {args.max_chunk_bytes / MIB:.1f} MiB), {-(-T // plan.tokens)} token chunks x "
        f"{-(-V // plan.vocab)} vocab blocks"
    )
    print(f"a full float32 [{T}, {V}] logits tensor: {full_bytes / MIB:.1f} MiB")

    r = measure(T, V, D, args.max_chunk_bytes)
    base = r["inputs"] + r["grads"]
    print(f"\nforward {r['forward_s']:.1f} s, backward {r['backward_s']:.1f} s")
    print(
        f"inputs (hidden, weight, labels, grad_out) {r['inputs'] / MIB:.1f} MiB, "
        f"gradients (d_hidden, d_weight, out) {r['grads'] / MIB:.1f} MiB"
    )
    checks = []
    print("\n[1] peak memory of forward+backward (inputs and gradients count)")
    for label, key in (("tensor", "tensor_peak"), ("RSS", "rss_peak")):
        print(f"    {label:<6} {r[key] / MIB:9.1f} MiB")
    print("\n[2] peak / full [T x V] float32 logits")
    for label, key in (("tensor", "tensor_peak"), ("RSS", "rss_peak")):
        ratio = r[key] / full_bytes
        checks.append(ratio < 0.1)
        print(f"    {label:<6} {ratio:.4f}   goal < 0.1   {verdict(ratio, 0.1)}")
    print("\n[3] peak beyond inputs and gradients, in logits tiles (one tile + per-token buffers expected)")
    for label, key in (("tensor", "tensor_peak"), ("RSS", "rss_peak")):
        extra = r[key] - base
        tiles = extra / tile_bytes
        checks.append(tiles <= 1.5)
        print(f"    {label:<6} {extra / MIB:8.1f} MiB = {tiles:.2f} tiles   goal <= 1.5   {verdict(tiles, 1.5)}")
    print("\n[4] log-probs of 8 tokens against reference_label_logprobs (float32, one [8, V] log_softmax)")
    checks.append(r["probe_err"] <= 1e-4)
    print(f"    max |diff| {r['probe_err']:.2e}   goal <= 1e-4   {verdict(r['probe_err'], 1e-4)}")
    print(f"\n{sum(checks)}/{len(checks)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
