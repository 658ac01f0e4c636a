"""The log-prob head's tile alignment: one-pass forward+backward with the planned (aligned) tile against the same
budget's unaligned token count, on one rank's packed row (issue 31's 8K row by default).

Run ``python benchmarks/head_tile_align.py [--tokens 8184] [--vocab 32768] [--hidden 256] [--threads 2]
[--rounds 5]``. :func:`~ringtune.models.logprob_tiles.tile_shape` rounds a budget-sized tile down to a multiple of
``TILE_TOKEN_ALIGN``; before, 12 × 682 = 8184 tokens gave 255-token tiles, whose odd leading dimension ran the
vocabulary-major logits GEMM at about half speed on x86. Prints both tile shapes, each round's time of
``label_logprobs`` (float32, every token scored, the upstream gradient known: the service's path) and the median
ratio aligned / unaligned (goal <= 0.9), then the two results' largest difference (they must agree to float32
rounding: the same sums in other tile groupings).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from attention_cp import verdict

from ringtune.models.logprob_head import label_logprobs
from ringtune.models.logprob_tiles import tile_shape

GOAL = 0.9


def head_step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> tuple:
    """One forward+backward of the one-pass head; (log-probs, d_hidden, d_weight), seconds."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    upstream = torch.full(labels.shape, -1.0)
    start = time.perf_counter()
    out = label_logprobs(h, w, labels, chunk_tokens=chunk_tokens, upstream=upstream)
    (-out.sum()).backward()
    seconds = time.perf_counter() - start
    return (out.detach(), h.grad, w.grad), seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8184, help="the rank's tokens (8184 = 12 x 682)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = (args.tokens, args.vocab, args.hidden)
    aligned = tile_shape(*shape, acc_bytes=4, weight_bytes=4).tokens
    unaligned = tile_shape(*shape, acc_bytes=4, weight_bytes=4, align=1).tokens
    print(f"head of {args.tokens} tokens x vocab {args.vocab}, hidden {args.hidden}, float32, {args.threads} threads")
    print(f"  tile tokens: planned (aligned) {aligned}, the budget's own count {unaligned}")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen)
    weight = torch.randn(args.vocab, args.hidden, generator=gen) * args.hidden**-0.5
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    results = {}
    for name, tokens in (("aligned", aligned), ("unaligned", unaligned)):  # warm-up; kept for the comparison
        results[name], _ = head_step(hidden, weight, labels, tokens)
    times: dict[str, list[float]] = {"aligned": [], "unaligned": []}
    for _ in range(args.rounds):
        for name, tokens in (("aligned", aligned), ("unaligned", unaligned)):
            times[name].append(head_step(hidden, weight, labels, tokens)[1])
    per_round = [a / u for a, u in zip(times["aligned"], times["unaligned"], strict=True)]
    print(f"  aligned   s: {' '.join(f'{t:.3f}' for t in times['aligned'])}")
    print(f"  unaligned s: {' '.join(f'{t:.3f}' for t in times['unaligned'])}")
    ratio = statistics.median(per_round)
    print(f"  aligned / unaligned per round: min {min(per_round):.3f}, median {ratio:.3f} (goal <= {GOAL}) "
          f"{verdict(ratio, GOAL)}")  # fmt: skip
    diff = max(float((a - b).abs().max()) for a, b in zip(results["aligned"], results["unaligned"], strict=True))
    print(f"  largest difference of log-probs / d_hidden / d_weight between the two: {diff:.2e}")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
