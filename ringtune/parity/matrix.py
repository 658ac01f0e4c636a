"""``ringtune parity matrix``: serve several layouts one after another, run the parity client against each,
compare every CP > 1 layout with CP=1 at the same row budget, and write the validation report (Markdown table
plus one PNG per comparison, :mod:`ringtune.parity.report`).

Beside the CP × DP × GDN-mode × dtype grid and the MoE layouts, ``option_layouts`` serves every other option of
``ringtune serve`` (:data:`OPTIONS_DEFAULT`, a slice that crosses each option at CP 2 and 4; :func:`options_full`,
the product): attention ring / allgather / alltoall (Ulysses), precision, ``--shard-params`` none / dp / dp_cp, LoRA
(rank 32, ``--lora-pass-runs`` with a companion run, ``--shared-decode`` on / off), ``--recompute`` and the
long-row profile; each against the CP=1 server of :meth:`ServeSpec.reference` (same precision, LoRA and profile).
With ``faults``, each debug fault is also served at its layout (:data:`FAULT_SPECS`) and must FAIL compare
against its clean CP=1 reference.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringtune.parity.client import load_dump, run_parity
from ringtune.parity.compare import compare_dumps
from ringtune.parity.matrix_types import MatrixConfig, MatrixReport, MatrixRow
from ringtune.parity.plot import plot_deltas
from ringtune.parity.report import replica_cell, write_report
from ringtune.parity.servers import API_KEY, ServeSpec, moe_specs, row_budget_specs, running_server
from ringtune.parity.slices import record_slice, slice_entry
from ringtune.parity.tiny_checkpoint import tiny_qwen35_dir

FAULT_SPECS: dict[str, dict[str, Any]] = {
    "position_off_by_one": {"cp": 2},
    "gradients_averaged": {"cp": 2},
    "gdn_state_dropped": {"cp": 2, "linear_cp_mode": "chunkwise"},  # the state hand-off exists only in chunkwise
    "loss_sign_flipped": {"cp": 2},
    "weight_decay_skipped_cp1": {"cp": 2},
    "unscored_backward_skipped": {"cp": 2},  # the tail datum leaves CP rank 1 unscored
    "gdn_decay_relayout_bf16": {"cp": 2, "linear_cp_mode": "chunkwise", "dtype": "bfloat16"},  # a bf16 rounding
    # at CP=2 each hop carries one block: exact; the model-level figures stay within bf16 noise at CP=4 too: the
    # server's ring-accumulation probe catches it
    "ring_dkv_exchange_bf16": {"cp": 4, "dtype": "bfloat16"},
    "ring_shift_reversed": {"cp": 4},  # a ring of two has one neighbour: CP=4 only
    # one per option of issue 34, each at a layout that serves its option
    "allgather_kv_rank_reversed": {"cp": 4, "linear_cp_mode": "chunkwise", "attention": "allgather"},
    "mixed_cast_detached_last_cp": {"cp": 2, "dtype": "bf16-mixed"},  # replicated: FSDP casts before the layer
    "sharded_step_count_cp1": {"cp": 2, "shard_params": "dp_cp"},  # only the replica check of step counts sees it
    "lora_grads_doubled_last_cp": {"cp": 2, "lora_rank": 32},
    "recompute_rerun_shifted": {"cp": 2, "recompute": "selective"},
    "long_row_positions_carried": {"cp": 2, "long_rows": True},  # rows of > 32 datums: the long-row profile only
}
"""The :class:`ServeSpec` options each debug fault is served with (its must-fail layout; float32, headwise GDN
and ring attention unless named)."""
FAULT_LAYOUTS: dict[str, tuple[int, str, str]] = {
    name: (o["cp"], o.get("linear_cp_mode", "headwise"), o.get("dtype", "float32")) for name, o in FAULT_SPECS.items()
}
"""(CP, GDN mode, dtype) of each fault's layout (the part of :data:`FAULT_SPECS` every fault has)."""
OPTIONS_DEFAULT: tuple[dict[str, Any], ...] = (
    {"cp": 2, "dtype": "bf16-mixed", "attention": "alltoall", "shard_params": "dp_cp"},
    {"cp": 4, "dtype": "bf16-mixed", "linear_cp_mode": "chunkwise", "attention": "allgather", "shard_params": "dp_cp"},
    {"dp": 2, "cp": 2, "dtype": "bf16-mixed", "linear_cp_mode": "chunkwise", "shard_params": "dp"},
    {"cp": 2, "linear_cp_mode": "chunkwise", "lora_rank": 32, "lora_pass_runs": 2},
    {"cp": 4, "attention": "allgather", "lora_rank": 32, "lora_pass_runs": 2, "shared_decode": False},
    {"cp": 2, "linear_cp_mode": "chunkwise", "recompute": "full", "long_rows": True},
    {"cp": 4, "recompute": "selective", "long_rows": True},
    {"cp": 2, "dtype": "float64", "linear_cp_mode": "chunkwise"},
    {"cp": 4, "dtype": "float64"},
)
"""The default slice of the options (beside the float32 grid, which serves ring attention, replicated parameters and
full fine-tuning at CP 2 and 4 in both GDN modes; float64 is served at CP 2 chunkwise and CP 4 headwise only, to keep
the default within 1.5x of the grid it replaced): alltoall (Ulysses; CP=2 only: the tiny model has 2 KV heads) and
allgather, bf16-mixed, dp_cp at CP 2 and 4 and dp at DP2 x CP2, LoRA 32 with joined passes at CP 2 and 4 (shared
decode off at CP 4), recompute full / selective with the long-row profile at CP 2 / 4. Three more CP=1
references: bf16-mixed, LoRA (2 runs/pass), the long-row profile, float64; float32 is the grid's."""


def options_full() -> tuple[dict[str, Any], ...]:
    """The product of the options (``--full``): every precision × CP 2 / 4 × attention (alltoall at CP 2) ×
    sharding (dp also at DP2×CP2), but the plain ring+none layouts the grid serves already; LoRA 32 in float32
    and bf16-mixed × CP 2 / 4 × 1 / 2 runs per pass × shared decode on / off; recompute none / full / selective
    × CP 2 / 4 on the long-row profile."""
    out: list[dict[str, Any]] = []
    for dtype, cp, attention, shard in itertools.product(
        ("float32", "bfloat16", "bf16-mixed", "float64"), (2, 4), ("ring", "allgather", "alltoall"), SHARDS
    ):
        if (attention == "alltoall" and cp != 2) or (attention, shard) == ("ring", "none"):
            continue
        out.append(
            {"cp": cp, "dtype": dtype, "linear_cp_mode": "chunkwise", "attention": attention, "shard_params": shard}
        )
        if shard == "dp" and cp == 2:
            out.append({**out[-1], "dp": 2})
    for dtype, cp, runs, decode in itertools.product(("float32", "bf16-mixed"), (2, 4), (1, 2), (True, False)):
        out.append({"cp": cp, "dtype": dtype, "lora_rank": 32, "lora_pass_runs": runs, "shared_decode": decode})
    for cp, recompute in itertools.product((2, 4), ("none", "full", "selective")):
        out.append({"cp": cp, "linear_cp_mode": "chunkwise", "recompute": recompute, "long_rows": True})
    return tuple(out)


SHARDS = ("none", "dp", "dp_cp")
EMBEDDED = "smollm2-135m"
MOE_DEFAULT: tuple[tuple[int, int, int], ...] = ((1, 2, 2),)
"""(DP, CP, EP) of the tiny Qwen3.5-MoE in the default matrix."""
MOE_FULL: tuple[tuple[int, int, int], ...] = ((1, 2, 2), (1, 4, 2), (1, 4, 4), (2, 2, 2))
"""... and in ``--full`` (EP inside CP, EP across all ranks, two expert replicas across DP)."""


@dataclass(frozen=True)
class PlannedComparison:
    """One candidate server of the matrix and the CP=1 server it is held against (``tag``: the model's name in
    the report; ``expect_fail``: a debug fault, which must FAIL compare)."""

    tag: str
    spec: ServeSpec
    reference: ServeSpec
    expect_fail: bool = False


def plan_matrix(config: MatrixConfig, *, tiny: str, moe_tiny: str) -> list[PlannedComparison]:
    """Every comparison of ``config``, in serving order: the tiny-Qwen3.5 grid per dtype, the embedded model, the
    MoE layouts per dtype, the option layouts, the faults (each fault at its :data:`FAULT_SPECS` layout).
    ``tiny`` / ``moe_tiny``: the tiny checkpoints' folders (the MoE's is unused without ``moe_layouts``)."""
    planned: list[PlannedComparison] = []
    groups = [("tiny-qwen3.5", tiny, config.cps, config.dps, config.modes, d, config.row_tokens) for d in config.dtypes]
    if config.embedded_cps:
        groups.append(
            ("smollm2-135m", EMBEDDED, config.embedded_cps, (1,), ("headwise",), "float32", config.embedded_row_tokens)
        )
    for tag, model, cps, dps, modes, dtype, row_tokens in groups:
        specs = row_budget_specs(model, cps=cps, modes=modes, dtype=dtype, row_tokens=row_tokens, dps=dps)
        planned += [PlannedComparison(tag, spec, specs[0]) for spec in specs[1:]]
    for dtype in config.dtypes if config.moe_layouts else ():
        specs = moe_specs(moe_tiny, layouts=config.moe_layouts, dtype=dtype, row_tokens=config.row_tokens)
        planned += [PlannedComparison("tiny-qwen3.5-moe", spec, specs[0]) for spec in specs[1:]]
    for options in config.option_layouts:
        spec = ServeSpec(model=tiny, max_tokens_per_rank=config.row_tokens // int(options["cp"]), **options)
        planned.append(PlannedComparison("tiny-qwen3.5", spec, spec.reference()))
    for fault in config.faults:
        options = FAULT_SPECS[fault]
        spec = ServeSpec(
            model=tiny, max_tokens_per_rank=config.row_tokens // options["cp"], debug_fault=fault, **options
        )
        planned.append(PlannedComparison("tiny-qwen3.5", spec, spec.reference(), expect_fail=True))
    return planned


def slice_of(planned: Sequence[PlannedComparison], index: int, count: int) -> list[PlannedComparison]:
    """Part ``index`` (1-based) of ``count`` contiguous, near-equal parts of ``planned`` (contiguous: the layouts
    of one reference stay together, so a slice serves few references). ValueError unless 1 <= index <= count."""
    if not 1 <= index <= count:
        raise ValueError(f"slice {index}/{count}: want 1 <= I <= N")
    n = len(planned)
    return list(planned[(index - 1) * n // count : index * n // count])


def _run(spec: ServeSpec, config: MatrixConfig, tag: str, report: MatrixReport) -> tuple[dict[str, Any], float]:
    start = time.monotonic()
    path = config.workdir / f"{tag}-{spec.name}.json"
    if config.reuse and path.is_file():
        dump = load_dump(path)
        return dump, float(dump.get("seconds", 0.0))
    report.served.append(spec.name)
    with running_server(spec, config.workdir) as url:
        dump = run_parity(
            url,
            path,
            api_key=API_KEY,
            seed=config.seed,
            long_context=config.long_context,
            label=f"{tag} {spec.name}",
            lora_rank=spec.lora_rank,
            companion=spec.companion,
            long_rows=spec.long_rows,
        )
    served = time.monotonic() - start
    report.server_seconds[spec.name] = served
    print(f"  {tag} {spec.name}: served, ran and stopped in {served:.0f} s", flush=True)
    return dump, float(dump["seconds"])


def _compare(
    report: MatrixReport, config: MatrixConfig, planned: PlannedComparison, reference: dict[str, Any]
) -> MatrixRow:
    tag, spec = planned.tag, planned.spec
    dump, seconds = _run(spec, config, tag, report)
    result = compare_dumps(reference, dump)
    png = plot_deltas(result, config.png_dir / f"{tag}-{spec.name}.png")
    row = MatrixRow(tag, spec, result, png, seconds, planned.expect_fail, replica_cell(dump))
    report.rows.append(row)
    verdict = "FAIL" if result.failures else "pass"
    names = ", ".join(f.name for f in result.failures[:4])
    print(f"  {tag} {spec.name}: {verdict} {names} ({seconds:.0f} s)", flush=True)
    return row


def run_matrix(config: MatrixConfig) -> MatrixReport:
    """Serve, run and compare every layout of ``config`` (of its slice, ``config.slice``), each reference served
    once, just before its first candidate; write ``config.doc``; returns the report."""
    started = time.monotonic()
    report = MatrixReport()
    tiny = str(tiny_qwen35_dir(config.workdir / "tiny-qwen3.5"))
    moe_tiny = (
        str(tiny_qwen35_dir(config.workdir / "tiny-qwen3.5-moe", family="qwen3_5_moe")) if config.moe_layouts else ""
    )
    whole = plan_matrix(config, tiny=tiny, moe_tiny=moe_tiny)
    planned = slice_of(whole, *config.slice)
    references: dict[tuple[str, str], dict[str, Any]] = {}
    for item in planned:
        key = (item.tag, item.reference.name)
        if key not in references:
            print(f"parity matrix: {item.tag}: reference {item.reference.name}", flush=True)
            references[key], _ = _run(item.reference, config, item.tag, report)
        _compare(report, config, item, references[key])
    report.wall_seconds = time.monotonic() - started
    if config.slice != (1, 1) and config.slices_json is not None:
        record_slice(config.slices_json, slice_entry(report, *config.slice, planned=len(whole)))
    write_report(report, config)
    return report
