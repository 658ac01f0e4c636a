"""Expert parallelism on CPU/gloo: per-rank expert memory and all-to-all bytes per token, against goals.

Run ``python benchmarks/moe_ep.py [--tokens 2048] [--hidden 256]``. One MoE layer (``SparseMoE``) at the
expert counts of the target models (Qwen3.5-35B-A3B: 256 experts, top-8, a shared expert; Qwen3-30B-A3B:
128 experts, top-8), hidden size scaled down (bytes per token scale with it; the ratios do not), random
routers over normal inputs (logits of std 1: routing spread over every expert). Every figure is measured in this
run on 4 gloo ranks (EP = 4, every rank its own tokens):

1. expert parameter bytes per rank at EP = 4 over EP = 1 (goal <= 0.3; gradients and AdamW moments follow
   the parameters), and the whole MoE layer's (router and shared expert stay whole on every rank);
2. bytes each rank sends in the forward dispatch + combine (meter ops ``expert_dispatch`` /
   ``expert_combine``) per token, against the minimum: a token goes once to each distinct remote rank that
   holds one of its experts and one summed result comes back (what ringtune sends), against one copy per
   remote (token, expert) pair (the simple scheme); the routes (an int64 and a weight per remote
   assignment) and counts are shown apart. The backward sends the same rows again (checked).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from ringtune.models.layers.moe import SparseMoE, is_expert_parameter, set_expert_parallel
from ringtune.parallel import measure_comm, spawn

MODELS = {"qwen3_5_moe (256 experts, top-8, shared)": (256, 8, True), "qwen3_moe (128 experts, top-8)": (128, 8, False)}
EP = 4


def _block(experts: int, top_k: int, shared: bool, hidden: int) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(hidden, hidden // 4, experts, top_k, True, hidden // 2 if shared else 0)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, hidden**-0.5)  # logits of std 1 over normal inputs
    return block


def worker(rank: int, experts: int, top_k: int, shared: bool, hidden: int, tokens: int) -> dict[str, float]:
    full = _block(experts, top_k, shared, hidden)
    block = _block(experts, top_k, shared, hidden)
    set_expert_parallel(block, dist.group.WORLD)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    with measure_comm() as forward:
        y = block(x)
    with measure_comm() as backward:
        y.square().sum().backward()
    _, ids = block.gate(x.detach())
    owner = torch.div(ids, experts // EP, rounding_mode="floor")
    distinct = sum(len(set(row[row != rank].tolist())) for row in owner)

    def size(m, experts_only: bool) -> int:
        return sum(
            p.numel() * p.element_size() for n, p in m.named_parameters() if is_expert_parameter(n) or not experts_only
        )

    sent = forward.by_op.get("expert_dispatch", 0) + forward.by_op.get("expert_combine", 0)
    back = backward.by_op.get("expert_dispatch_grad", 0) + backward.by_op.get("expert_combine_grad", 0)
    return {
        "expert_ratio": size(block, True) / size(full, True),
        "layer_ratio": size(block, False) / size(full, False),
        "sent": sent,
        "back": back,
        "routes": forward.by_op.get("expert_routes", 0) + forward.by_op.get("expert_counts", 0),
        "minimum": 2 * distinct * hidden * x.element_size(),
        "copies": 2 * int((owner != rank).sum()) * hidden * x.element_size(),
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    ok = True
    for name, (experts, top_k, shared) in MODELS.items():
        res = spawn(worker, EP, experts, top_k, shared, args.hidden, args.tokens, threads=1)
        tokens = sum(r["tokens"] for r in res)
        sent, back, minimum = (sum(r[k] for r in res) for k in ("sent", "back", "minimum"))
        copies = sum(r["copies"] for r in res)
        expert_ratio = max(r["expert_ratio"] for r in res)
        print(f"{name}, EP={EP}, hidden {args.hidden}, {args.tokens} tokens per rank, float32:")
        verdict = "PASS" if expert_ratio <= 0.3 else "FAIL"
        ok &= verdict == "PASS"
        print(
            f"  expert bytes per rank EP{EP}/EP1: {expert_ratio:.3f} (goal <= 0.3: {verdict}); whole MoE layer "
            f"{max(r['layer_ratio'] for r in res):.3f}"
        )
        routes = sum(r["routes"] for r in res)
        print(
            f"  forward hidden rows (dispatch+combine): {sent / tokens:.0f} B per token; minimum "
            f"{minimum / tokens:.0f}: ratio {sent / minimum:.3f} (goal <= 1.0: "
            f"{'PASS' if sent <= minimum else 'FAIL'}); one copy per remote (token, expert) would send "
            f"{copies / tokens:.0f} ({copies / minimum:.3f}x); routes + counts {routes / tokens:.0f} B per token"
        )
        ok &= sent <= minimum
        print(f"  backward sends {back / sent:.3f}x the forward")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
