"""The Markdown validation report of ``ringtune parity matrix`` (docs/validation.md): one row per compared layout,
one per debug fault, the measured noise floors behind the bf16 limits and the matrix's wall time."""

from __future__ import annotations

import json
from typing import Any

from ringtune.parity.compare import Comparison
from ringtune.parity.matrix_types import MatrixConfig, MatrixReport
from ringtune.parity.servers import ServeSpec
from ringtune.parity.slices import slices_section


def replica_cell(dump: dict[str, Any]) -> str:
    """The dump's replica check: tensors compared per step and the mean milliseconds it took (rank 0)."""
    checks = list((dump.get("replica_check") or {}).values())
    if not checks:
        return "not run"
    tensors = max(c["tensors"] for c in checks)
    if tensors == 0:
        return "no replicas"
    return f"{tensors:.0f} in {sum(c['ms'] for c in checks) / len(checks):.1f} ms"


def _list(values) -> str:
    return "/".join(str(v) for v in values) if values else "none"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def layout_cell(spec: ServeSpec) -> str:
    """``CP2 headwise``, ``DP2 CP1``, ``CP2 chunkwise EP2``, ``CP4 chunkwise allgather, shard dp_cp``, ``CP2
    headwise, LoRA 32 (2 runs/pass, no shared decode)``, ``CP4 headwise, recompute selective, long rows``: the
    report's layout cell (every option that is not the default)."""
    dp = f"DP{spec.dp} " if spec.dp > 1 else ""
    ep = f" EP{spec.ep}" if spec.ep > 1 else ""
    cell = f"{dp}CP{spec.cp}" + (f" {spec.linear_cp_mode}" if spec.cp > 1 else "") + ep
    cell += f" {spec.attention}" if spec.attention != "ring" else ""
    extras = [f"shard {spec.shard_params}"] if spec.shard_params != "none" else []
    if spec.lora_rank:
        joined = [f"{spec.lora_pass_runs} runs/pass"] if spec.lora_pass_runs > 1 else []
        joined += [] if spec.shared_decode else ["no shared decode"]
        extras.append(f"LoRA {spec.lora_rank}" + (f" ({', '.join(joined)})" if joined else ""))
    elif not spec.shared_decode:
        extras.append("no shared decode")
    extras += [f"recompute {spec.recompute}"] if spec.recompute != "none" else []
    extras += ["long rows"] if spec.long_rows else []
    return ", ".join([cell, *extras])


def _sampler_cell(result: Comparison) -> str:
    """The candidate's ``sampler_kl.k3 (max_abs)``, or "not measured"."""
    figures = {f.name: f for f in result.figures}
    if "sampler_kl.k3" not in figures:
        return "not measured"
    return f"{_fmt(figures['sampler_kl.k3'].value)} ({_fmt(figures['sampler_kl.max_abs'].value)})"


def _probe_cell(result: Comparison) -> str:
    """The candidate's ``probe.ring_accumulation`` (the fraction of dQ/dK/dV not rounded once), or "n/a"."""
    figures = {f.name: f for f in result.figures}
    return _fmt(figures["probe.ring_accumulation"].value) if "probe.ring_accumulation" in figures else "n/a"


def write_report(report: MatrixReport, config: MatrixConfig) -> None:
    """The Markdown validation report at ``config.doc`` (PNG links relative to it)."""
    doc = config.doc
    doc.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Validation: DP and CP layouts against one rank through the Tinker API",
        "",
        "Written by `ringtune parity matrix` (docs/parity.md). Each layout is a `ringtune serve` subprocess driven by",
        "the real `tinker` SDK (`ringtune parity run`) and compared with the DP=1, CP=1 server of the same model and",
        "dtype at the same packed-row budget (`max_tokens_per_rank · CP` = "
        f"{config.row_tokens} tokens on the tiny model) by `ringtune parity compare` (limits in",
        "`ringtune/parity/limits.py`, with their reasoning). `|Δlp|`: the starting-weight forwards;",
        "worst window: the largest window/interior ratio over zigzag chunks, chunk boundaries and GDN split rows;",
        "grad norm: `gn_CP / gn_CP1` of the first optimizer step (cross_entropy), and the largest",
        "`|gn_CP / gn_CP1 - 1|` of all four steps; sampler KL: the layout's own KL(sampler ‖ trainer) (k3",
        "estimate, and the largest `|lp_trainer - lp_sampler|`) on its samples after the steps",
        "(`ringtune/parity/sampler_kl.py`); replica check / step: the tensors a rank shares with another (parameters,",
        "AdamW moments and step counts, rotary tables; under dp_cp only the step counts and tables) compared",
        "bit-for-bit across the ranks after each optimizer step and the mean milliseconds on rank 0",
        "(`ringtune/engine/replica_check.py`); ring probe: the fraction of the ring's dQ/dK/dV elements (bf16",
        "servers, on their own ranks) that differ from the same blocks summed in float64 and rounded once",
        "(`ringtune/probes/ring_accumulation.py`; n/a where the dtype is its own accumulator); s: seconds of the",
        "client run (server start-up excluded).",
        "",
        f"This run served CP {_list(config.cps)}, DP {_list(config.dps)}, GDN modes {_list(config.modes)}, dtypes "
        f"{_list(config.dtypes)}"
        + (f", SmolLM2-135M at CP {_list(config.embedded_cps)}" if config.embedded_cps else "")
        + (
            f", {len(config.option_layouts)} option layouts (attention, precision, sharding, LoRA, recompute, "
            "long rows)"
            if config.option_layouts
            else ""
        )
        + (f", and the faults {', '.join(config.faults)}" if config.faults else "")
        + (f"; slice {config.slice[0]}/{config.slice[1]} of those layouts" if config.slice != (1, 1) else "")
        + ". "
        + _wall(report),
        "",
        "| model | dtype | layout | result | mean \\|Δlp\\| | p99 \\|Δlp\\| | worst window | step-1 grad norm ratio "
        "| max \\|ratio-1\\| (4 steps) | sampler KL (max \\|Δ\\|) | replica check / step | ring probe | plot | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    faults = []
    for row in report.rows:
        if row.expect_fail:
            faults.append(row)
            continue
        r = row.result
        png = row.png.relative_to(doc.parent) if row.png.is_relative_to(doc.parent) else row.png
        if "lp.mean" not in {f.name for f in r.figures}:  # the run ended in a server error
            failed = ", ".join(f"{f.name} ({f.note[:120]})" for f in r.failures)
            lines.append(
                f"| {row.model} | {row.spec.dtype} | {layout_cell(row.spec)} | **FAIL** {failed} "
                f"| | | | | | | {row.replica} | | [png]({png}) | {row.seconds:.0f} |"
            )
            continue
        window = max((f for f in r.figures if f.kind == "ratio"), key=lambda f: f.value)
        gn = r.figure("grad_norm.cross_entropy")
        worst_gn = max(f.value for f in r.figures if f.name.startswith("grad_norm."))
        ratio = gn.note.split(" / ")
        gn_ratio = float(ratio[0]) / float(ratio[1])
        verdict = "pass" if row.ok else "**FAIL** " + ", ".join(f.name for f in r.failures[:3])
        lines.append(
            f"| {row.model} | {row.spec.dtype} | {layout_cell(row.spec)} | {verdict} "
            f"| {_fmt(r.figure('lp.mean').value)} | {_fmt(r.figure('lp.p99').value)} "
            f"| {window.name} {window.value:.2f}x | {gn_ratio:.12f} | {_fmt(worst_gn)} | {_sampler_cell(r)} "
            f"| {row.replica} | {_probe_cell(r)} | [png]({png}) | {row.seconds:.0f} |"
        )
    if faults:
        lines += [
            "",
            "## Negative controls (`ringtune serve --debug-fault NAME`, each at its layout)",
            "",
            "Each fault must FAIL compare against the clean CP=1 reference (exit 1, the failing figures named).",
            "",
            "| fault | layout | dtype | compare | failing figures (first 6) | plot |",
            "|---|---|---|---|---|---|",
        ]
        for row in faults:
            r = row.result
            names = ", ".join(f"`{f.name}` ({f.value:.3g} > {f.limit:.3g})" for f in r.failures[:6])
            png = row.png.relative_to(doc.parent) if row.png.is_relative_to(doc.parent) else row.png
            verdict = f"exit 1, {len(r.failures)} figures" if r.failures else "**passed (not caught)**"
            lines.append(
                f"| `{row.spec.debug_fault}` | {layout_cell(row.spec)} | {row.spec.dtype} | {verdict} | {names} "
                f"| [png]({png}) |"
            )
    lines += noise_section(config)
    lines += slices_section(config.slices_json)
    lines.append("")
    doc.write_text("\n".join(lines))


def _wall(report: MatrixReport) -> str:
    """The matrix's wall time, or that every dump was reused (``--reuse``: no server started, no time measured)."""
    if not report.served:
        return "Every dump was reused from `--workdir` (`--reuse`): the wall times are docs/parity.md's."
    top = sorted(report.server_seconds.items(), key=lambda kv: -kv[1])[:3]
    slowest = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in top)
    return (
        f"Wall time of this matrix on this machine: {report.wall_seconds:.0f} s ({len(report.served)} servers started"
        + (f"; served, ran and stopped, the slowest: {slowest}" if top else "")
        + ")."
    )


def noise_section(config: MatrixConfig) -> list[str]:
    """The measured noise floors (``ringtune parity noise``'s JSON at ``config.noise_json``), if there."""
    if config.noise_json is None or not config.noise_json.is_file():
        return []
    floors: dict[str, dict[str, Any]] = json.loads(config.noise_json.read_text())
    keys = [k for k in next(iter(floors.values())) if k not in ("seconds", "command")]
    lines = [
        "",
        "## Noise floors (`ringtune parity noise`): the spread between mathematically equal computations",
        "",
        "One server per precision and CP size runs the parity requests unpermuted and with every request's datums",
        "in one or two seeded orders (each datum packed into another row, offset and batch); each figure is the",
        "largest of the permuted runs against the unpermuted one. `ringtune/parity/limits.py` derives the bfloat16 and",
        f"bf16-mixed limits from these (`limits_from_noise`). Source: `{config.noise_json.name}`.",
        "",
        "| precision | " + " | ".join(keys) + " | s |",
        "|---|" + "---|" * (len(keys) + 1),
    ]
    for dtype, row in floors.items():
        cells = " | ".join(_fmt(float(row[k])) for k in keys)
        lines.append(f"| {dtype} | {cells} | {float(row.get('seconds', 0)):.0f} |")
    return lines
