"""The ``ringtune`` command line."""

from __future__ import annotations

import argparse
import sys

from ringtune.probes.attention_parity import AttentionShape
from ringtune.probes.attention_parity_run import AttentionParityConfig, run_attention_parity
from ringtune.testing.scenarios import SCENARIOS


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringtune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = AttentionParityConfig()
    p = sub.add_parser("attention-parity", help="CP attention variants vs the single-process reference (gloo, CPU)")
    p.add_argument("--cp", type=int, default=d.cp, help="CP size (ranks spawned on this host)")
    p.add_argument("--modes", type=_csv, default=d.modes, help="comma list of ring,allgather,alltoall")
    p.add_argument("--dtype", default=d.dtype, choices=["float64", "float32", "bfloat16"])
    p.add_argument("--scenarios", type=_csv, default=d.scenarios, help=f"comma list of {','.join(SCENARIOS)}")
    p.add_argument("--heads", type=int, default=d.shape.heads)
    p.add_argument("--kv-heads", type=int, default=d.shape.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.shape.head_dim)
    p.add_argument("--scale", type=float, default=d.shape.scale)
    p.add_argument("--sharpness", type=float, default=d.shape.sharpness)
    p.add_argument("--seed", type=int, default=d.seed)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "attention-parity":
        unknown = [s for s in args.scenarios if s not in SCENARIOS]
        if unknown:
            print(f"error: --scenarios {unknown} unknown; choose from {list(SCENARIOS)}", file=sys.stderr)
            return 2
        config = AttentionParityConfig(
            cp=args.cp,
            modes=args.modes,
            dtype=args.dtype,
            scenarios=args.scenarios,
            shape=AttentionShape(
                heads=args.heads,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                scale=args.scale,
                sharpness=args.sharpness,
            ),
            seed=args.seed,
        )
        return 0 if run_attention_parity(config) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
