"""``ringtune parity run | compare | matrix | noise``: the command line of the parity client (docs/parity.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ringtune.debug_faults import DEBUG_FAULTS
from ringtune.errors import UserInputError


def add_parity_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``parity`` and its three subcommands on the ``ringtune`` parser."""
    p = sub.add_parser("parity", help="prove through the Tinker API that a CP layout changes nothing but memory")
    verbs = p.add_subparsers(dest="parity_command", required=True)
    r = verbs.add_parser("run", help="send the fixed parity requests to a server, dump what came back (JSON)")
    r.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    r.add_argument("--out", required=True, help="dump file to write")
    r.add_argument("--api-key", default=None, help="X-API-Key (default: $TINKER_API_KEY or tml-local)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--long-context", type=int, default=None, help="cap the long datums below the context length")
    r.add_argument("--label", default=None, help="name of this run in reports (default: the URL)")
    r.add_argument("--lora-rank", type=int, default=0, help="run on a LoRA run of this rank (0: full fine-tuning)")
    r.add_argument(
        "--companion", action="store_true", help="a second LoRA run submits beside it (--lora-pass-runs >= 2 joins)"
    )
    r.add_argument(
        "--long-rows", action="store_true", help="add the long-row profile (rows of 48 datums, mesh prefill)"
    )
    r.add_argument("--permute", type=int, default=None, help="send each request's datums in this seed's order")
    c = verbs.add_parser("compare", help="compare dump B (candidate) with dump A (reference); exit 1 on a failure")
    c.add_argument("reference")
    c.add_argument("candidate")
    c.add_argument("--noise", default=None, help="dump of another correct layout: widens each limit to its deviation")
    c.add_argument("--png", default=None, help="write the per-position delta plot here")
    c.add_argument("--json", default=None, help="write every figure here")
    c.add_argument("--verbose", action="store_true", help="print every figure, not only the summary and failures")
    m = verbs.add_parser("matrix", help="serve layouts one after another, compare each with CP=1, write the report")
    m.add_argument(
        "--full",
        action="store_true",
        help="CP 1/2/4 and DP 1/2 (DP·CP <= 4) x both GDN modes x float32/bfloat16/float64, SmolLM2-135M at "
        "CP 1/2, a tiny Qwen3.5-MoE at four (DP, CP, EP) layouts, the product of the serve options (attention x "
        "precision x sharding, LoRA, recompute with long rows) and every debug fault",
    )
    m.add_argument(
        "--no-options", action="store_true", help="skip the option layouts (attention, sharding, LoRA, long rows)"
    )
    m.add_argument("--noise-json", default="docs/validation/noise.json", help="noise floors shown in the report")
    m.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes (default 1 2 4)")
    m.add_argument("--dp", type=int, nargs="+", default=None, help="DP sizes (default 1; DP·CP <= 4)")
    m.add_argument("--modes", nargs="+", default=None, choices=["headwise", "chunkwise"])
    m.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=["float32", "bfloat16", "float64", "bf16-mixed", "bf16-exact"],
        help="default float32 (float64 at CP 2 chunkwise and CP 4 headwise is among the option layouts)",
    )
    m.add_argument(
        "--faults", nargs="*", default=None, choices=DEBUG_FAULTS, help="debug faults to serve, each at its layout"
    )
    m.add_argument(
        "--moe", nargs="*", default=None, help="tiny Qwen3.5-MoE layouts as DP,CP,EP (default 1,2,2; none: skip)"
    )
    m.add_argument("--row-tokens", type=int, default=1024, help="tokens per packed row (= context length)")
    m.add_argument("--embedded-cp", type=int, nargs="*", default=None, help="CP sizes for SmolLM2-135M")
    m.add_argument("--long-context", type=int, default=None)
    m.add_argument("--workdir", default="parity-work", help="dumps, server logs, the tiny model")
    m.add_argument("--doc", default=None, help="the report (default docs/validation.md; sliced: in --workdir)")
    m.add_argument("--png-dir", default=None, help="its plots (default docs/validation; sliced: in --workdir)")
    m.add_argument("--reuse", action="store_true", help="re-compare dumps already in --workdir instead of serving")
    m.add_argument(
        "--slice",
        default=None,
        metavar="I/N",
        help="serve only part I of N of the layouts (implies --reuse: run the parts one after another in one "
        "--workdir); the tally goes to --slices-json",
    )
    m.add_argument("--slices-json", default="docs/validation/full-slices.json", help="record of the slices run")
    n = verbs.add_parser("noise", help="measure each precision's noise floor: CP=1 with its requests permuted")
    n.add_argument("--dtypes", nargs="+", default=["bf16-mixed", "bfloat16", "float32"])
    n.add_argument("--row-tokens", type=int, default=1024, help="tokens per packed row (= context length)")
    n.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="CP sizes measured (chunkwise GDN at CP > 1)")
    n.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="permutation seeds (one client run each)")
    n.add_argument("--workdir", default="parity-work", help="dumps, server logs, the tiny model")
    n.add_argument("--out", default="docs/validation/noise.json", help="the floors per precision (JSON)")


def _moe_layouts(given: list[str] | None, full: bool) -> tuple[tuple[int, int, int], ...]:
    """``--moe`` as (DP, CP, EP) triples; the default set (or ``--full``'s) when not given."""
    from ringtune.parity.matrix import MOE_DEFAULT, MOE_FULL

    if given is None:
        return MOE_FULL if full else MOE_DEFAULT
    out = []
    for text in given:
        parts = text.split(",")
        if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise UserInputError(f"--moe {text!r}: expected DP,CP,EP (positive integers), e.g. 1,2,2")
        out.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return tuple(out)


def run_parity_command(args: argparse.Namespace) -> int:
    """Exit status: 0 pass, 1 a figure failed (compare) or a layout misbehaved (matrix), 2 refused input."""
    if args.parity_command == "run":
        import os

        from ringtune.parity.client import run_parity

        key = args.api_key or os.environ.get("TINKER_API_KEY")
        dump = run_parity(
            args.url,
            args.out,
            api_key=key,
            seed=args.seed,
            long_context=args.long_context,
            label=args.label,
            lora_rank=args.lora_rank,
            companion=args.companion,
            long_rows=args.long_rows,
            permute=args.permute,
        )
        layout = dump["layout"]
        print(
            f"parity run: {len(dump['records'])} requests, grad norms {dump['grad_norms']} against "
            f"CP={layout['cp_size']} DP={layout['dp_size']} {layout['dtype']} ({dump['seconds']} s) -> {args.out}"
        )
        return 0
    if args.parity_command == "compare":
        from ringtune.parity.client import load_dump
        from ringtune.parity.compare import ComparisonRefusedError, compare_dumps, format_report
        from ringtune.parity.plot import plot_deltas

        try:
            a, b = load_dump(args.reference), load_dump(args.candidate)
            noise = load_dump(args.noise) if args.noise else None
            result = compare_dumps(a, b, noise)
        except (ComparisonRefusedError, ValueError, FileNotFoundError) as exc:
            print(f"error: compare refused: {exc}", file=sys.stderr)
            return 2
        print(format_report(result, verbose=args.verbose))
        if args.png:
            plot_deltas(result, args.png)
        if args.json:
            figures = [
                {"name": f.name, "value": f.value, "limit": f.limit, "ok": f.ok, "kind": f.kind, "note": f.note}
                for f in result.figures
            ]
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return 1 if result.failures else 0
    if args.parity_command == "noise":
        return _run_noise(args)
    from ringtune.parity.matrix import OPTIONS_DEFAULT, MatrixConfig, options_full, run_matrix
    from ringtune.parity.slices import parse_slice

    full = args.full
    options = () if args.no_options else (options_full() if full else OPTIONS_DEFAULT)
    try:
        part = parse_slice(args.slice) if args.slice else (1, 1)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    workdir = Path(args.workdir).resolve()
    sliced = f"validation-slice-{part[0]}-of-{part[1]}" if args.slice else ""
    config = MatrixConfig(
        workdir=workdir,
        doc=Path(args.doc or (workdir / f"{sliced}.md" if sliced else "docs/validation.md")).resolve(),
        png_dir=Path(args.png_dir or (workdir / sliced if sliced else "docs/validation")).resolve(),
        cps=tuple(args.cp or (1, 2, 4)),
        dps=tuple(args.dp or ((1, 2) if full else (1,))),
        modes=tuple(args.modes or ("headwise", "chunkwise")),
        dtypes=tuple(args.dtypes or (("float32", "bfloat16", "float64") if full else ("float32",))),
        row_tokens=args.row_tokens,
        embedded_cps=tuple(args.embedded_cp if args.embedded_cp is not None else ((1, 2) if full else ())),
        faults=tuple(args.faults if args.faults is not None else (DEBUG_FAULTS if full else ())),
        moe_layouts=_moe_layouts(args.moe, full),
        option_layouts=options,
        noise_json=Path(args.noise_json).resolve(),
        long_context=args.long_context,
        reuse=args.reuse or bool(args.slice),
        slice=part,
        slices_json=Path(args.slices_json).resolve(),
    )
    report = run_matrix(config)
    bad = [r for r in report.rows if not r.ok]
    for r in bad:
        what = "was not caught" if r.expect_fail else f"failed: {', '.join(f.name for f in r.result.failures[:6])}"
        print(f"parity matrix: {r.model} {r.spec.name} {what}", file=sys.stderr)
    print(f"parity matrix: {len(report.rows) - len(bad)}/{len(report.rows)} as expected; report {config.doc}")
    return 0 if not bad else 1


def _run_noise(args: argparse.Namespace) -> int:
    """``ringtune parity noise``: measure and write the floors; print one line per precision."""
    from ringtune.parity.noise import measure_noise, write_floors
    from ringtune.parity.servers import ServeSpec
    from ringtune.parity.tiny_checkpoint import tiny_qwen35_dir

    workdir = Path(args.workdir).resolve()
    tiny = str(tiny_qwen35_dir(workdir / "tiny-qwen3.5"))
    floors: dict[str, dict[str, float]] = {}
    for dtype in args.dtypes:
        for cp in args.cp:
            start = time.monotonic()
            mode = "chunkwise" if cp > 1 else "headwise"
            spec = ServeSpec(
                model=tiny, dtype=dtype, cp=cp, linear_cp_mode=mode, max_tokens_per_rank=args.row_tokens // cp
            )
            _, measured = measure_noise(spec, workdir, seeds=args.seeds)
            key = f"{dtype} CP{cp}"
            floors[key] = {**measured, "seconds": round(time.monotonic() - start, 1)}
            print(f"parity noise: {key}: " + ", ".join(f"{k} {v:.3g}" for k, v in floors[key].items()), flush=True)
            write_floors(floors, Path(args.out))  # after each, so a cut run keeps what it measured
    write_floors(floors, Path(args.out))
    print(f"parity noise: floors -> {args.out}")
    return 0
