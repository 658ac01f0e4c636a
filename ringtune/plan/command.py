"""``ringtune plan``: predicted per-rank memory for every layout of a GPU count; the layouts that fit, best first.

ringtune plan --model Qwen3.5-27B --context-length 131072 --gpus 8 --gpu-memory 80GiB [--json]
ringtune plan --model Qwen3.5-27B --model Qwen3.5-4B ...   (two base models served together:
    :mod:`ringtune.plan.model_set`)
ringtune plan --model Qwen3.5-27B ... --gpus 16 --gpus-per-node 8 --vllm-engines auto --vllm-tp 2
    (GPUs split between training ranks and vLLM sampling engines: :mod:`ringtune.plan.gpu_split`)
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
from ringtune.plan.gpu_split import Split, describe_engine, format_splits, plan_splits, recommended
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
        default=None,
        help=f"whole sampler snapshots each rank holds beside the step (default {DEFAULT_MAX_SNAPSHOTS}, the sampler "
        "pool's limit; with --vllm-engines 0: the engines sample; 0 for training without sampling from run weights)",
    )
    p.add_argument(
        "--image-tokens",
        type=int,
        default=0,
        help="image-pad tokens per row (a vision-language model: the vision tower's patches, m^2 per token; 0: text)",
    )
    add_split_options(p)
    p.add_argument("--top", type=int, default=12, help="rows of the table (0: every layout)")
    p.add_argument("--json", action="store_true", help="every layout as JSON on stdout")


def add_split_options(p: argparse.ArgumentParser) -> None:
    """``plan``'s options for a split between training ranks and vLLM engines (``--vllm-engines``)."""
    p.add_argument(
        "--vllm-engines",
        default=None,
        help="split the GPUs between training ranks and vLLM sampling engines (serve --sampler vllm): 'auto' "
        "(every split, the recommended one marked) or a total engine count",
    )
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: --gpus, one node)")
    p.add_argument("--vllm-tp", type=int, default=1, help="GPUs per engine (tensor x pipeline parallel size)")
    p.add_argument("--vllm-dtype", default="bfloat16", help="the engine's dtype (bfloat16, float16, float32)")
    p.add_argument(
        "--vllm-context", type=int, default=None, help="tokens per sampled sequence (default: --context-length)"
    )
    p.add_argument(
        "--vllm-sequences",
        type=int,
        default=64,
        help="sequences the engines should hold at once, in all (e.g. RL groups x group size; default 64)",
    )
    p.add_argument(
        "--vllm-memory-utilization", type=float, default=0.9, help="vLLM's --gpu-memory-utilization (default 0.9)"
    )


def run_split(args: argparse.Namespace, cfg, name: str, memory: int) -> int:
    """``plan --vllm-engines``: the engine's needs, every split (or the one asked), the recommended one; 0 when
    one is recommended, else 1; with ``--json`` all as JSON."""
    engines = None if args.vllm_engines == "auto" else _int_flag("--vllm-engines", args.vllm_engines)
    sample_context = args.vllm_context or args.context_length
    splits = plan_splits(
        cfg,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node or args.gpus,
        gpu_memory=memory,
        context=args.context_length,
        engine_gpus=args.vllm_tp,
        engine_dtype=args.vllm_dtype,
        sample_context=sample_context,
        utilization=args.vllm_memory_utilization,
        engines=engines,
        precisions=tuple(args.precision),
        recompute=tuple(args.recompute),
        sampler_snapshots=args.sampler_snapshots,
        image_tokens=args.image_tokens,
    )
    best = recommended(splits, args.vllm_sequences)
    if args.json:
        out = {"model": name, "gpus": args.gpus, "gpu_memory_bytes": memory, "sequences_wanted": args.vllm_sequences}
        out |= {"splits": [s.as_dict() for s in splits], "recommended": None if best is None else best.engines}
        print(json.dumps(out, indent=1))
        return 0 if best else 1
    needs = splits[0].needs
    print(
        f"{name}: {args.gpus} x {memory / GIB:.1f} GiB ({args.gpus_per_node or args.gpus} per node); training rows of "
        f"{args.context_length} tokens; engines of --vllm-tp {args.vllm_tp} should hold {args.vllm_sequences} "
        f"sequences of {sample_context} tokens"
    )
    print(describe_engine(needs, args.vllm_dtype, memory, args.vllm_memory_utilization))
    print(format_splits(splits, best))
    if best is None:
        print(
            "no split holds the sequences with a training layout that fits: more GPUs, a larger --vllm-tp, fewer "
            "--vllm-sequences or a shorter --vllm-context"
        )
        return 1
    print(serve_hint(best, args.vllm_tp, args.gpus_per_node or args.gpus, args.gpus))
    return 0


def serve_hint(best: Split, engine_gpus: int, gpus_per_node: int, gpus: int) -> str:
    """The ``serve`` flags of split ``best``: its layout, the engines of the first node (``serve`` starts engines
    on its own node only: those of other nodes are started there and attached with ``--vllm-url``)."""
    nodes = gpus // gpus_per_node
    devices = ",".join(str(i) for i in range(best.ranks_per_node, gpus_per_node))
    layout = best.training.estimate.layout if best.training else None
    flags = "" if layout is None else f"--cp {layout.cp} --dp {layout.dp} --shard-params {layout.shard} "
    hint = (
        f"serve: {flags}--sampler vllm --vllm-engines {best.engines // nodes} --vllm-devices {devices} "
        f"--vllm-args='--tensor-parallel-size {engine_gpus}' (ranks on GPUs 0..{best.ranks_per_node - 1})"
    )
    if nodes > 1:
        hint += f"; the {best.engines - best.engines // nodes} engine(s) of the other nodes: start them there on the "
        hint += "same GPUs and attach each with --vllm-url"
    return hint


def _int_flag(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserInputError(f"{flag}={text!r}: expected 'auto' or an integer") from None


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
        if args.sampler_snapshots is None:  # vLLM engines sample: the ranks hold no snapshot
            args.sampler_snapshots = DEFAULT_MAX_SNAPSHOTS if args.vllm_engines is None else 0
        if args.vllm_engines is not None:
            if len(models) > 1:
                raise UserInputError("--vllm-engines plans one --model; plan each served model's split on its own")
            return run_split(args, models[0][1], name, memory)
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
