"""``ringtune parity matrix``: serve several layouts one after another, run the parity client against each,
compare every CP > 1 layout with CP=1 at the same row budget, and write the validation report (Markdown table
plus one PNG per comparison). With ``faults``, each debug fault is also served at its layout
(:data:`FAULT_LAYOUTS`) and must FAIL compare against the clean CP=1 reference of its dtype.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtune.debug_faults import DEBUG_FAULTS
from ringtune.parity.client import load_dump, run_parity
from ringtune.parity.compare import Comparison, compare_dumps
from ringtune.parity.plot import plot_deltas
from ringtune.parity.servers import API_KEY, ServeSpec, moe_specs, row_budget_specs, running_server
from ringtune.parity.tiny_checkpoint import tiny_qwen35_dir

FAULT_LAYOUTS: dict[str, tuple[int, str, str]] = {
    "position_off_by_one": (2, "headwise", "float32"),
    "gradients_averaged": (2, "headwise", "float32"),
    "gdn_state_dropped": (2, "chunkwise", "float32"),  # the state hand-off exists only in chunkwise
    "loss_sign_flipped": (2, "headwise", "float32"),
    "weight_decay_skipped_cp1": (2, "headwise", "float32"),
    "unscored_backward_skipped": (2, "headwise", "float32"),  # the tail datum leaves CP rank 1 unscored
    "gdn_decay_relayout_bf16": (2, "chunkwise", "bfloat16"),  # a bfloat16 rounding: only a bf16 server has it
    "ring_dkv_exchange_bf16": (4, "headwise", "bfloat16"),  # at CP=2 each hop carries one block: exact; the
    # model-level figures stay within bf16 noise at CP=4 too: the server's ring-accumulation probe catches it
    "ring_shift_reversed": (4, "headwise", "float32"),  # a ring of two has one neighbour: CP=4 only
}
"""The (CP, GDN mode, dtype) each debug fault is served at (its must-fail layout)."""
EMBEDDED = "smollm2-135m"
MOE_DEFAULT: tuple[tuple[int, int, int], ...] = ((1, 2, 2),)
"""(DP, CP, EP) of the tiny Qwen3.5-MoE in the default matrix."""
MOE_FULL: tuple[tuple[int, int, int], ...] = ((1, 2, 2), (1, 4, 2), (1, 4, 4), (2, 2, 2))
"""... and in ``--full`` (EP inside CP, EP across all ranks, two expert replicas across DP)."""


@dataclass(frozen=True, kw_only=True)
class MatrixConfig:
    """What the matrix serves.

    Attributes:
        workdir: dumps, server logs and the tiny model go here.
        doc, png_dir: the Markdown report and its PNGs (PNG links in ``doc`` are relative to its folder).
        cps, modes, dtypes: the tiny-Qwen3.5 layouts (CP=1 is the reference of each dtype).
        dps: DP sizes of the tiny-Qwen3.5 layouts (DP > 1: with every CP of ``cps`` while DP·CP <= 4).
        row_tokens: tokens one packed row holds (``max_tokens_per_rank · CP``): the servers' context length.
        embedded_cps: CP sizes for the embedded SmolLM2-135M (float32, ring attention); empty = skip it.
        embedded_row_tokens: its row budget (smaller: 135M parameters on a CPU).
        faults: debug faults to serve, each at its :data:`FAULT_LAYOUTS` layout; each must fail compare against
            the CP=1 reference of its dtype (served for the faults if ``dtypes`` lacks it).
        moe_layouts: (DP, CP, EP) layouts of a tiny Qwen3.5-MoE (routers that differ per token), each compared
            with its own DP=1, CP=1, EP=1 reference in every dtype of ``dtypes``; empty = skip it.
        long_context: cap of the long datums (None: the servers' context length).
        reuse: take a layout's dump from ``workdir`` when it is there already (re-compare without serving).
    """

    workdir: Path
    doc: Path
    png_dir: Path
    cps: tuple[int, ...] = (1, 2, 4)
    dps: tuple[int, ...] = (1,)
    modes: tuple[str, ...] = ("headwise", "chunkwise")
    dtypes: tuple[str, ...] = ("float32", "float64")
    row_tokens: int = 1024
    embedded_cps: tuple[int, ...] = ()
    embedded_row_tokens: int = 512
    faults: tuple[str, ...] = ()
    moe_layouts: tuple[tuple[int, int, int], ...] = ()
    long_context: int | None = None
    seed: int = 0
    reuse: bool = False


@dataclass
class MatrixRow:
    """One compared layout (or one fault run) of the report."""

    model: str
    spec: ServeSpec
    result: Comparison
    png: Path
    seconds: float
    expect_fail: bool = False
    replica: str = "not run"  # the candidate's replica check per optimizer step: "<tensors> in <ms> ms"

    @property
    def ok(self) -> bool:
        if self.expect_fail:
            return bool(self.result.failures)
        return not self.result.failures


@dataclass
class MatrixReport:
    rows: list[MatrixRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


def _run(spec: ServeSpec, config: MatrixConfig, tag: str) -> tuple[dict[str, Any], float]:
    start = time.monotonic()
    path = config.workdir / f"{tag}-{spec.name}.json"
    if config.reuse and path.is_file():
        dump = load_dump(path)
        return dump, float(dump.get("seconds", 0.0))
    with running_server(spec, config.workdir) as url:
        dump = run_parity(
            url,
            path,
            api_key=API_KEY,
            seed=config.seed,
            long_context=config.long_context,
            label=f"{tag} {spec.name}",
        )
    print(f"  {tag} {spec.name}: served, ran and stopped in {time.monotonic() - start:.0f} s", flush=True)
    return dump, float(dump["seconds"])


def _compare(
    report: MatrixReport,
    config: MatrixConfig,
    tag: str,
    spec: ServeSpec,
    reference: dict[str, Any],
    *,
    expect_fail: bool = False,
) -> MatrixRow:
    dump, seconds = _run(spec, config, tag)
    result = compare_dumps(reference, dump)
    png = plot_deltas(result, config.png_dir / f"{tag}-{spec.name}.png")
    row = MatrixRow(tag, spec, result, png, seconds, expect_fail, replica_cell(dump))
    report.rows.append(row)
    verdict = "FAIL" if result.failures else "pass"
    names = ", ".join(f.name for f in result.failures[:4])
    print(f"  {tag} {spec.name}: {verdict} {names} ({seconds:.0f} s)", flush=True)
    return row


def run_matrix(config: MatrixConfig) -> MatrixReport:
    """Serve, run and compare every layout of ``config``; write ``config.doc``; returns the report."""
    report = MatrixReport()
    tiny = str(tiny_qwen35_dir(config.workdir / "tiny-qwen3.5"))
    groups: list[tuple[str, str, Sequence[int], Sequence[int], Sequence[str], str, int]] = [
        ("tiny-qwen3.5", tiny, config.cps, config.dps, config.modes, dtype, config.row_tokens)
        for dtype in config.dtypes
    ]
    moe_tiny = (
        str(tiny_qwen35_dir(config.workdir / "tiny-qwen3.5-moe", family="qwen3_5_moe")) if config.moe_layouts else ""
    )
    if config.embedded_cps:
        groups.append(
            ("smollm2-135m", EMBEDDED, config.embedded_cps, (1,), ("headwise",), "float32", config.embedded_row_tokens)
        )
    references: dict[str, dict[str, Any]] = {}
    for tag, model, cps, dps, modes, dtype, row_tokens in groups:
        specs = row_budget_specs(model, cps=cps, modes=modes, dtype=dtype, row_tokens=row_tokens, dps=dps)
        print(f"parity matrix: {tag} {dtype}: reference {specs[0].name}", flush=True)
        reference, _ = _run(specs[0], config, tag)
        if tag == "tiny-qwen3.5":
            references[dtype] = reference
        for spec in specs[1:]:
            _compare(report, config, tag, spec, reference)
    for dtype in config.dtypes if config.moe_layouts else ():
        specs = moe_specs(moe_tiny, layouts=config.moe_layouts, dtype=dtype, row_tokens=config.row_tokens)
        print(f"parity matrix: tiny-qwen3.5-moe {dtype}: reference {specs[0].name}", flush=True)
        reference, _ = _run(specs[0], config, "tiny-qwen3.5-moe")
        for spec in specs[1:]:
            _compare(report, config, "tiny-qwen3.5-moe", spec, reference)
    for fault in config.faults:
        cp, mode, dtype = FAULT_LAYOUTS[fault]
        if dtype not in references:
            spec = ServeSpec(model=tiny, cp=1, dtype=dtype, max_tokens_per_rank=config.row_tokens)
            references[dtype], _ = _run(spec, config, "tiny-qwen3.5")
        spec = ServeSpec(
            model=tiny,
            cp=cp,
            dtype=dtype,
            linear_cp_mode=mode,
            max_tokens_per_rank=config.row_tokens // cp,
            debug_fault=fault,
        )
        _compare(report, config, "tiny-qwen3.5", spec, references[dtype], expect_fail=True)
    write_report(report, config)
    return report


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


def _layout(spec: ServeSpec) -> str:
    """``CP2 headwise``, ``DP2 CP1``, ``DP2 CP2 chunkwise``, ``CP2 chunkwise EP2``: the report's layout cell."""
    dp = f"DP{spec.dp} " if spec.dp > 1 else ""
    ep = f" EP{spec.ep}" if spec.ep > 1 else ""
    return f"{dp}CP{spec.cp}" + (f" {spec.linear_cp_mode}" if spec.cp > 1 else "") + ep


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
        "(`ringtune/parity/sampler_kl.py`); replica check / step: the tensors (parameters and both AdamW moments)",
        "compared bit-for-bit across the ranks after each optimizer step and the mean milliseconds on rank 0",
        "(`ringtune/engine/replica_check.py`); ring probe: the fraction of the ring's dQ/dK/dV elements (bf16",
        "servers, on their own ranks) that differ from the same blocks summed in float64 and rounded once",
        "(`ringtune/probes/ring_accumulation.py`; n/a where the dtype is its own accumulator); s: seconds of the",
        "client run (server start-up excluded).",
        "",
        f"This run served CP {_list(config.cps)}, DP {_list(config.dps)}, GDN modes {_list(config.modes)}, dtypes "
        f"{_list(config.dtypes)}"
        + (f", SmolLM2-135M at CP {_list(config.embedded_cps)}" if config.embedded_cps else "")
        + (f", and the faults {', '.join(config.faults)}" if config.faults else "")
        + ".",
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
                f"| {row.model} | {row.spec.dtype} | {_layout(row.spec)} | **FAIL** {failed} "
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
            f"| {row.model} | {row.spec.dtype} | {_layout(row.spec)} | {verdict} "
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
                f"| `{row.spec.debug_fault}` | {_layout(row.spec)} | {row.spec.dtype} | {verdict} | {names} "
                f"| [png]({png}) |"
            )
    lines.append("")
    doc.write_text("\n".join(lines))


ALL_FAULTS = DEBUG_FAULTS
