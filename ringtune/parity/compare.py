"""``ringtune parity compare A B [--noise C]``: the figures that say whether candidate B (a CP layout) changed
anything but memory against reference A (CP=1), each with its limit.

Log-prob deltas ``Δ = lp_B - lp_A`` per scored position. Figures (``value <= limit`` passes):

- ``lp.mean`` / ``lp.p99``: mean and 99th percentile of ``|Δ|`` over every position of the forwards at the
  starting weights (``forward.*``); ``lp.trimmed_kl``: the mean of ``k3 = e^Δ - 1 - Δ`` (≈ Δ²/2, a per-token
  KL estimate from label log-probs) over the long rows' positions below their 99th percentile (a few flipped
  tokens do not dominate; short rows stay out, they have their own gate);
- ``lp.images.mean`` / ``lp.images.p99``: the same over the image datums' forward (``forward.images``), when the
  servers take images; their ``long_step.images`` and ``after.images`` count among the requests after a step;
- ``lp.short[<datum>].max``: each short row's (and the lone datum's) largest ``|Δ|`` at the starting weights;
- windows, as the ratio of their mean ``|Δ|`` to the long rows' interior mean (positions near no chunk boundary
  and in no split window): ``lp.chunk[k]`` (zigzag chunk k), ``lp.boundary[k]`` (``[b-2, b+2)`` around the
  k-th chunk boundary), ``lp.split[<datum>@<row>]`` (``[s-2, s+16)`` around each chunkwise-GDN split row).
  Positions come from :mod:`ringtune.parity.windows` under the layout with the larger CP. A window passes if
  its ratio is at most :attr:`Limits.window_ratio` or its mean is below the dtype's noise floor;
- ``loss.<record>.per_token``: the largest ``|ΔL_i| / n_i`` over the datums of a request (per-datum summed loss,
  per token); ``grad_norm.<step>``: ``|gn_B / gn_A - 1|`` of each optimizer step;
- ``lp.<record>.mean`` / ``.p99`` for the requests after the first optimizer step (looser: AdamW's first steps
  are sign-like, so layout noise in a near-zero gradient component moves that weight by up to ±lr);
- ``replicas.identical`` (1 when a request of the run failed because ranks that must hold identical parameters
  and AdamW moments did not: :mod:`ringtune.engine.replica_check`, checked after every optimizer step; limit 0)
  and ``server.error`` (1 when a request failed with another server error); either ends the comparison: the
  dump holds nothing after it;
- ``sampler_kl.k3`` / ``sampler_kl.max_abs``: the candidate's own KL(sampler ‖ trainer) on its samples (k3 estimate)
  and largest ``|lp_trainer - lp_sampler|`` (:mod:`ringtune.parity.sampler_kl`), when its dump measured them; the
  reference's figures are shown beside them. Not a difference of two servers: each server's decode path must
  agree with its own training forward.

``--noise C`` (another correct layout against the same reference) widens each limit to 1.5× the figure C shows
(windows: 1.5× C's window/interior ratio at the same rows).

A reference packed with another row budget (``max_tokens_per_rank · CP``) or pad multiplier than the candidate,
or holding other data, is refused (:class:`ComparisonRefusedError`): repacking alone moves numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ringtune.parity.limits import COARSENESS, LIMITS, Limits
from ringtune.parity.windows import DatumPositions, Layout, request_positions

PRE_STEP = ("forward.main", "forward.lone", "forward.long")
POST_STEP = (
    "importance_sampling",
    "cispo",
    "long_step.lone",
    "long_step.long",
    "long_step.tail",
    "long_step.images",
    "long_step.packed",
    "after.main",
    "after.long",
    "after.images",
    "after.packed",
    "prefill.mesh",
)
"""Requests after the first step (``*.packed`` and ``prefill.mesh``: the long-row profile, when both ran it)."""
LOSS_RECORDS = (
    "cross_entropy",
    "importance_sampling",
    "cispo",
    "long_step.lone",
    "long_step.long",
    "long_step.tail",
    "long_step.images",
    "long_step.packed",
)
REPLICA_DIVERGED = "replicas diverged"
"""What a server error says when the ranks' replicas came apart (ringtune.engine.replica_check)."""
LONG_KINDS = ("text", "long")
NOISE_WIDENING = 1.5


class ComparisonRefusedError(ValueError):
    """The two dumps cannot be compared (other data, row budget or pad multiplier)."""


@dataclass
class Figure:
    """One compared quantity: ``value`` against ``limit``; windows also pass below ``floor`` (their mean)."""

    name: str
    value: float
    limit: float
    kind: str = "abs"  # "abs" or "ratio" (a window: value = window mean / interior mean)
    mean: float = float("nan")  # windows: the window's own mean |Δ|
    floor: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        if not np.isfinite(self.value):
            return False
        return self.value <= self.limit or (self.kind == "ratio" and self.mean <= self.floor)


@dataclass
class Comparison:
    """Every figure of B against A, the layouts, and per-position deltas (for the plot)."""

    reference: str
    candidate: str
    dtype: str
    layout: Layout
    figures: list[Figure]
    deltas: list[dict[str, Any]] = field(default_factory=list)  # long rows: name, |Δ| array, positions

    @property
    def failures(self) -> list[Figure]:
        return [f for f in self.figures if not f.ok]

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)


def row_budget(dump: Mapping[str, Any]) -> int:
    """Tokens one packed row may hold over its CP group: ``max_tokens_per_rank · cp_size``."""
    layout = dump["layout"]
    return int(layout["max_tokens_per_rank"]) * int(layout["cp_size"])


def check_comparable(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """ComparisonRefusedError unless A and B hold the same data, row budget and pad multiplier."""
    if a["data_digest"] != b["data_digest"]:
        raise ComparisonRefusedError(
            f"the dumps hold different data (digest {a['data_digest'][:12]} vs {b['data_digest'][:12]}): run both "
            "with the same --seed and --long-context on the same model"
        )
    ra, rb = row_budget(a), row_budget(b)
    la, lb = a["layout"], b["layout"]
    if ra != rb:
        want = rb // int(la["cp_size"])
        raise ComparisonRefusedError(
            f"the reference packs rows of {ra} tokens (max_tokens_per_rank={la['max_tokens_per_rank']} x "
            f"CP={la['cp_size']}), the candidate {rb} (max_tokens_per_rank={lb['max_tokens_per_rank']} x "
            f"CP={lb['cp_size']}); repacking alone moves the numbers. Re-run the reference with "
            f"--max-tokens-per-rank {want}"
        )
    if la.get("pad_multiplier", 8) != lb.get("pad_multiplier", 8):
        raise ComparisonRefusedError(
            f"pad multipliers differ: {la.get('pad_multiplier')} vs {lb.get('pad_multiplier')}"
        )


def _dtype(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The precision whose limits apply: the coarser of the two; bf16-exact against another precision differs by
    bf16 rounding, so at least bf16-mixed's (bf16-exact against itself is held to float32's)."""
    da, db = a["layout"]["dtype"], b["layout"]["dtype"]
    if da != db and "bf16-exact" in (da, db):
        return max(da, db, "bf16-mixed", key=COARSENESS.index)
    return max(da, db, key=COARSENESS.index)


def _deltas(ra: Mapping[str, Any], rb: Mapping[str, Any]) -> list[np.ndarray]:
    if ra["lengths"] != rb["lengths"]:
        raise ComparisonRefusedError(f"request lengths differ: {ra['lengths']} vs {rb['lengths']}")
    return [np.asarray(y) - np.asarray(x) for x, y in zip(ra["logprobs"], rb["logprobs"], strict=True)]


def _stat(values: np.ndarray, kind: str) -> float:
    if values.size == 0:
        return 0.0
    return float(np.mean(values)) if kind == "mean" else float(np.percentile(values, 99))


def compute_figures(a: Mapping[str, Any], b: Mapping[str, Any], *, window_layout: Layout, limits: Limits) -> Comparison:
    """Every figure of ``b`` against ``a`` (windows placed by ``window_layout``); see the module docstring."""
    figures: list[Figure] = []
    ra, rb = a["records"], b["records"]
    if set(ra) != set(rb):
        raise ComparisonRefusedError(f"the dumps hold other requests: {sorted(set(ra) ^ set(rb))} in one only")
    pre = {name: _deltas(ra[name], rb[name]) for name in PRE_STEP}
    everything = np.abs(np.concatenate([d for name in PRE_STEP for d in pre[name]]))
    figures.append(Figure("lp.mean", _stat(everything, "mean"), limits.lp_mean))
    figures.append(Figure("lp.p99", _stat(everything, "p99"), limits.lp_p99))
    if "forward.images" in ra:  # a server that takes images (ringtune.parity.image_datums)
        images = np.abs(np.concatenate(_deltas(ra["forward.images"], rb["forward.images"])))
        figures.append(Figure("lp.images.mean", _stat(images, "mean"), limits.lp_mean))
        figures.append(Figure("lp.images.p99", _stat(images, "p99"), limits.lp_p99))

    # Long rows of the starting-weight forwards: per-position classes under the window layout.
    positions = {
        name: request_positions(ra[name]["lengths"], window_layout) for name in ("forward.main", "forward.long")
    }
    long_abs, long_raw, rows = [], [], []
    for name, placed in positions.items():
        record = ra[name]
        for i, kind in enumerate(record["kinds"]):
            if kind in LONG_KINDS:
                delta = pre[name][i]
                rows.append((record["datums"][i], np.abs(delta), placed[i]))
                long_raw.append(delta)
                long_abs.append(np.abs(delta))
    raw = np.concatenate(long_raw)
    k3 = np.expm1(raw) - raw
    kept = k3[k3 <= np.percentile(k3, 99)]
    figures.append(Figure("lp.trimmed_kl", float(np.mean(kept)), limits.kl))
    figures.append(_local_chunk_figure(pre, positions, cpu=_on_cpu(a) and _on_cpu(b)))

    for name in ("forward.main", "forward.lone"):
        record = ra[name]
        for i, kind in enumerate(record["kinds"]):
            if kind in ("short", "lone"):
                value = float(np.max(np.abs(pre[name][i])))
                figures.append(Figure(f"lp.short[{record['datums'][i]}].max", value, limits.short_max))

    interior = np.concatenate([d[p.interior] for _, d, p in rows])
    interior_mean = max(_stat(interior, "mean"), 1e-300)

    def window(name: str, values: np.ndarray, note: str = "") -> None:
        mean = _stat(values, "mean")
        figures.append(
            Figure(name, mean / interior_mean, limits.window_ratio, "ratio", mean, limits.window_floor, note)
        )

    cp = window_layout.cp_size
    for k in range(2 * cp):
        window(f"lp.chunk[{k}]", np.concatenate([d[p.chunk == k] for _, d, p in rows]))
    for k in range(1, 2 * cp):
        window(f"lp.boundary[{k}]", np.concatenate([d[p.near_boundary == k] for _, d, p in rows]))
    for datum, d, p in rows:
        for j, s in enumerate(p.splits):
            window(f"lp.split[{datum}@{s}]", d[p.near_split == j], note=f"GDN split row {s} of {datum}")

    for name in (n for n in LOSS_RECORDS if n in ra):  # older dumps lack the newer requests
        x, y = ra[name], rb[name]
        per_token = max(abs(ly - lx) / n for lx, ly, n in zip(x["losses"], y["losses"], x["lengths"], strict=True))
        limit = limits.loss_per_token if name == "cross_entropy" else limits.post_loss_per_token
        figures.append(Figure(f"loss.{name}.per_token", per_token, limit))
    for step, gn_a in a["grad_norms"].items():
        gn_b = b["grad_norms"][step]
        value = abs(gn_b / gn_a - 1.0) if gn_a else abs(gn_b)
        limit = limits.grad_norm if step == "cross_entropy" else limits.grad_norm_later
        figures.append(Figure(f"grad_norm.{step}", value, limit, note=f"{gn_b:.10g} / {gn_a:.10g}"))
    for name in (n for n in ("cross_entropy", "forward.packed", *POST_STEP) if n in ra):
        d = np.abs(np.concatenate(_deltas(ra[name], rb[name])))
        pre_step = name in ("cross_entropy", "forward.packed")
        figures.append(Figure(f"lp.{name}.mean", _stat(d, "mean"), limits.lp_mean if pre_step else limits.post_mean))
        figures.append(Figure(f"lp.{name}.p99", _stat(d, "p99"), limits.lp_p99 if pre_step else limits.post_p99))

    figures += _sampler_figures(a.get("sampler_kl", {}), b.get("sampler_kl", {}), limits)
    figures += probe_figures(b.get("probes", {}))

    deltas = [{"datum": datum, "abs": d, "boundaries": p.boundaries, "splits": p.splits} for datum, d, p in rows]
    return Comparison(
        reference=str(a.get("label")),
        candidate=str(b.get("label")),
        dtype="",
        layout=window_layout,
        figures=figures,
        deltas=deltas,
    )


LOCAL_MOVED_LIMIT = 0.1
"""Largest fraction of zigzag-chunk-0 positions allowed to differ at all from the reference (see below)."""
CPU_ONLY = "CPU-only detector: not enforced off CPU"
"""The note of a detector that needs bit-deterministic kernels, reported but not enforced when a dump is not
from a CPU server (its layout's ``device_type``; dumps without one are from CPU servers)."""


def _on_cpu(dump: Mapping[str, Any]) -> bool:
    return dump["layout"].get("device_type", "cpu") == "cpu"


def _local_chunk_figure(
    pre: Mapping[str, list[np.ndarray]], positions: Mapping[str, list[DatumPositions]], *, cpu: bool = True
) -> Figure:
    """``lp.chunk[0].moved``: the fraction of the starting-weight positions in zigzag chunk 0 of their datum whose
    log-prob differs from the reference *at all*.

    A chunk-0 position's whole causal context is chunk 0 of its own datum, held by rank 0 and computed before any
    exchange: its attention is rank 0's step-0 block, its GDN scan starts at the datum's start (headwise: whole
    sequences; chunkwise: rank 0's contiguous part begins there). Every honest layout computes it with the
    reference's ops in the reference's order, so bit-identically, in every dtype (measured: exactly the chunk-0
    share of positions, 25% at CP=2 and 12.8% at CP=4, are unchanged in bfloat16). A perturbation applied to
    every token (a value rounded to another dtype on its way through a relayout) moves them: ~99% moved.
    The limit 10% leaves room for a kernel that picks another blocking for another row length.

    **CPU-only**: it rests on bit-deterministic kernels whose rounding does not depend on the row around a block
    (measured on the CPU kernels only). GPU attention and matmul kernels pick tilings, split-K and atomics by
    shape, so off CPU (``cpu=False``) the figure is reported with an infinite limit and the note
    :data:`CPU_ONLY`; the magnitude figures and the ring probe still apply there."""
    moved, total = 0, 0
    for name, placed in positions.items():  # forward.main and forward.long, placed by the window layout
        for delta, p in zip(pre[name], placed, strict=True):
            local = p.chunk == 0
            moved += int(np.count_nonzero(delta[local]))
            total += int(np.count_nonzero(local))
    value = moved / total if total else 0.0
    note = f"{moved} of {total} chunk-0 positions" + ("" if cpu else f"; {CPU_ONLY}")
    return Figure("lp.chunk[0].moved", value, LOCAL_MOVED_LIMIT if cpu else float("inf"), note=note)


def server_error_figures(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Figure]:
    """``replicas.identical`` / ``server.error`` (value 1, limit 0) for each dump whose run ended in a server
    error; empty when both ran every request."""
    figures = []
    for side, dump in (("candidate", b), ("reference", a)):
        error = dump.get("server_error")
        if not error:
            continue
        name = "replicas.identical" if REPLICA_DIVERGED in error["message"] else "server.error"
        note = f"{side}: {error['request']} failed: {error['message'][:300]}"
        figures.append(Figure(name, 1.0, 0.0, note=note))
    return figures


def probe_figures(probes: Mapping[str, Any]) -> list[Figure]:
    """``probe.ring_accumulation``: the largest fraction of the candidate's dQ/dK/dV elements that differ from
    the same blocks accumulated in float64 and rounded once (the server's own ranks; limit from the probe).
    None for a probe that does not apply (float32/float64 dtype, another attention mode) or was not run."""
    figures = []
    for name, summary in probes.items():
        if not summary.get("applies"):
            continue
        worst, field = max((float(v), k) for k, v in summary["mismatch"].items())
        where = f"{summary['dtype']} at CP={summary['cp']}"
        note = f"worst field {field}; {summary.get('elements', 0)} dK elements, {where}"
        figures.append(Figure(f"probe.{name}", worst, float(summary["limit"]), note=note))
    return figures


def _sampler_figures(ref: Mapping[str, Any], cand: Mapping[str, Any], limits: Limits) -> list[Figure]:
    """``sampler_kl.k3`` and ``sampler_kl.max_abs`` of the candidate (none if it did not measure them)."""
    if cand.get("status") != "measured":
        return []
    measured = ref.get("status") == "measured"
    return [
        Figure(
            f"sampler_kl.{key}",
            float(cand[key]),
            limit,
            note=f"reference {float(ref[key]):.3g}" if measured else "reference: not measured",
        )
        for key, limit in (("k3", limits.sampler_k3), ("max_abs", limits.sampler_max))
    ]


def compare_dumps(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    noise: Mapping[str, Any] | None = None,
) -> Comparison:
    """B against reference A (and the noise run C against A, to widen the limits). Raises ComparisonRefusedError."""
    check_comparable(a, b)
    la, lb = Layout.from_dump(a["layout"]), Layout.from_dump(b["layout"])
    window_layout = lb if lb.cp_size >= la.cp_size else la
    dtype = _dtype(a, b)
    limits = LIMITS[dtype]
    failed = server_error_figures(a, b)
    if failed:
        return Comparison(str(a.get("label")), str(b.get("label")), dtype, window_layout, failed)
    result = compute_figures(a, b, window_layout=window_layout, limits=limits)
    result.dtype = dtype
    if noise is not None:
        check_comparable(a, noise)
        base = compute_figures(a, noise, window_layout=window_layout, limits=limits)
        seen = {f.name: f for f in base.figures}
        widened = []
        for f in result.figures:
            n = seen.get(f.name)
            if n is not None and np.isfinite(n.value) and NOISE_WIDENING * n.value > f.limit:
                f = replace(f, limit=NOISE_WIDENING * n.value, note=(f.note + " (noise-widened)").strip())
            widened.append(f)
        result.figures = widened
    return result


def format_report(result: Comparison, *, verbose: bool = False) -> str:
    """The figures as text: every failure, and the summary figures (all of them with ``verbose``)."""
    lines = [
        f"parity: candidate {result.candidate} vs reference {result.reference} ({result.dtype} limits, windows at "
        f"CP={result.layout.cp_size})"
    ]
    summary = ("lp.mean", "lp.p99", "lp.trimmed_kl", "grad_norm.", "loss.", "lp.after", "sampler_kl.")
    worst_window = max((f for f in result.figures if f.kind == "ratio"), key=lambda f: f.value, default=None)
    for f in result.figures:
        shown = verbose or not f.ok or f.name.startswith(summary) or f is worst_window
        if shown:
            extra = f" (mean {f.mean:.3g}, floor {f.floor:.3g})" if f.kind == "ratio" else ""
            note = f"  [{f.note}]" if f.note else ""
            lines.append(f"  {'ok  ' if f.ok else 'FAIL'} {f.name:<40} {f.value:12.4g} <= {f.limit:.4g}{extra}{note}")
    failures = result.failures
    if failures:
        lines.append(f"FAILED: {len(failures)} figure(s): {', '.join(f.name for f in failures[:12])}")
    else:
        lines.append(f"passed: all {len(result.figures)} figures within their limits")
    return "\n".join(lines)
