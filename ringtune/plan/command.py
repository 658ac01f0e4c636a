"""``ringtune plan``: predicted per-rank memory for every layout of a GPU count; the layouts that fit, best first.

ringtune plan --model Qwen3.5-27B --context-length 131072 --gpus 8 --gpu-memory 80GiB [--json]
ringtune plan --model Qwen3.5-27B --model Qwen3.5-4B ...   (two base models served together:
    :mod:`ringtune.plan.model_set`)
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ringtune.engine.snapshot import DEFAULT_MAX_SNAPSHOTS
from ringtune.errors import UserInputError
from ringtune.models.recompute import RECOMPUTE_MODES
from ringtune.plan.estimate import PRECISIONS
from ringtune.plan.model_set import plan_model_set
from ringtune.plan.models import KNOWN_MODELS, resolve_model
from ringtune.plan.search import MARGIN, Planned, plan_layouts

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
GIB = 2**30


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes of ``80GiB``, ``141GB``, ``80 GiB``, ``512MiB``; UserInputError naming ``flag`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise UserInputError(
            f"{flag}={text!r}: expected a number and a unit, e.g. 80GiB or 141GB (units: {', '.join(UNITS)})"
        )
    value = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if value <= 0:
        raise UserInputError(f"{flag}={text!r}: must be > 0 bytes")
    return value


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predicted per-rank memory of each DPxCP layout; the layouts that fit")
    p.add_argument(
        "--model",
        required=True,
        action="append",
        help=f"HF config.json, checkpoint dir, or {' / '.join(KNOWN_MODELS)}; given more than once: the models "
        "served together (ringtune serve --model A --model B), each with one full fine-tuning run",
    )
    p.add_argument("--context-length", type=int, required=True, help="tokens per packed row")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all (CP x DP)")
    p.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB or 141GB")
    p.add_argument("--precision", nargs="+", default=list(PRECISIONS), help=f"any of {', '.join(PRECISIONS)}")
    p.add_argument("--recompute", nargs="+", default=list(RECOMPUTE_MODES), help="any of none, full, selective")
    p.add_argument(
        "--sampler-snapshots",
        type=int,
        default=DEFAULT_MAX_SNAPSHOTS,
        help=f"whole sampler snapshots each rank holds beside the step (default {DEFAULT_MAX_SNAPSHOTS}, the sampler "
        "pool's limit; 0 for training without sampling from run weights)",
    )
    p.add_argument(
        "--image-tokens",
        type=int,
        default=0,
        help="image-pad tokens per row (a vision-language model: the vision tower's patches, m^2 per token; 0: text)",
    )
    p.add_argument("--top", type=int, default=12, help="rows of the table (0: every layout)")
    p.add_argument("--json", action="store_true", help="every layout as JSON on stdout")


def _row(p: Planned) -> list[str]:
    e, lay = p.estimate, p.estimate.layout
    fit = "yes" if p.fits_with_margin else ("tight" if p.fits else "no")
    return [
        str(lay.cp),
        str(lay.dp),
        str(lay.ep),
        lay.shard,
        lay.recompute,
        lay.precision,
        *(f"{v / GIB:.1f}" for v in (e.parameters, e.gradients, e.moments, e.activations, e.constants)),
        f"{e.communication / GIB:.2f}",
        f"{e.snapshots / GIB:.1f}",
        f"{e.peak / GIB:.1f}",
        fit,
        f"{p.cost:.2f}",
    ]


HEADER = [
    "CP",
    "DP",
    "EP",
    "shard",
    "recompute",
    "precision",
    "param",
    "grad",
    "adam",
    "activ",
    "const",
    "comm",
    "snap",
    "peak",
    "fits",
    "cost",
]


def format_table(planned: list[Planned], top: int) -> str:
    """A plain-text table (GiB per rank) of the first ``top`` layouts (all when 0)."""
    rows = [HEADER] + [_row(p) for p in (planned if top == 0 else planned[:top])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [
        "  ".join(
            c.rjust(w) if i not in (3, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(lines)


def run_plan_command(args: argparse.Namespace) -> int:
    try:
        models = [resolve_model(m) for m in args.model]
        name = " + ".join(n for n, _ in models)
        memory = parse_memory(args.gpu_memory)
        if args.top < 0:
            raise UserInputError(f"--top={args.top}: must be >= 0")
        per_model = [
            plan_layouts(
                cfg,
                context=args.context_length,
                gpus=args.gpus,
                memory=memory,
                precisions=tuple(args.precision),
                recompute=tuple(args.recompute),
                sampler_snapshots=args.sampler_snapshots,
                image_tokens=args.image_tokens,
            )
            for _, cfg in models
        ]
        planned = per_model[0] if len(per_model) == 1 else plan_model_set(per_model, memory)
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "model": name,
            "context_length": args.context_length,
            "gpus": args.gpus,
            "gpu_memory_bytes": memory,
            "margin": MARGIN,
            "sampler_snapshots": args.sampler_snapshots,
            "image_tokens": args.image_tokens,
            "layouts": [
                {**p.estimate.as_dict(), "fits": p.fits, "fits_with_margin": p.fits_with_margin, "cost": p.cost}
                for p in planned
            ],
        }
        print(json.dumps(out, indent=1))
        return 0
    fitting = sum(p.fits for p in planned)
    print(
        f"{name}: {args.context_length} tokens per row on {args.gpus} x {memory / GIB:.1f} GiB; "
        f"{fitting} of {len(planned)} layouts fit (GiB per rank, best first; fits = with {MARGIN:.0%} free; snap = "
        f"{args.sampler_snapshots} sampler snapshot(s))"
    )
    print(format_table(planned, args.top))
    return 0 if fitting else 1
