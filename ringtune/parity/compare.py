"""``ringtune parity compare A B [--noise C]``: the figures that say whether candidate B (a CP layout) changed
anything but memory against reference A (CP=1), each with its limit.

Log-prob deltas ``Δ = lp_B - lp_A`` per scored position. Figures (``value <= limit`` passes):

- ``lp.mean`` / ``lp.p99``: mean and 99th percentile of ``|Δ|`` over every position of the forwards at the
  starting weights (``forward.*``); ``lp.trimmed_kl``: the mean of ``k3 = e^Δ - 1 - Δ`` (≈ Δ²/2, a per-token
  KL estimate from label log-probs) over the long rows' positions below their 99th percentile (a few flipped
  tokens do not dominate; short rows stay out, they have their own gate);
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

from ringtune.parity.windows import Layout, request_positions

PRE_STEP = ("forward.main", "forward.lone", "forward.long")
POST_STEP = ("importance_sampling", "cispo", "long_step.lone", "long_step.long", "after.main", "after.long")
LOSS_RECORDS = ("cross_entropy", "importance_sampling", "cispo", "long_step.lone", "long_step.long")
LONG_KINDS = ("text", "long")
NOISE_WIDENING = 1.5


class ComparisonRefusedError(ValueError):
    """The two dumps cannot be compared (other data, row budget or pad multiplier)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-dtype limits (the coarser dtype of the two dumps decides). See :data:`LIMITS` for the reasoning."""

    lp_mean: float
    lp_p99: float
    kl: float
    short_max: float
    window_ratio: float
    window_floor: float
    loss_per_token: float
    grad_norm: float
    grad_norm_later: float
    post_mean: float
    post_p99: float
    post_loss_per_token: float
    sampler_k3: float
    sampler_max: float


LIMITS: dict[str, Limits] = {
    # float64 compute, but log-probs and per-token losses cross the wire as float32: a log-prob of magnitude 4-16
    # rounds by up to 1 ulp = 4.8e-7..9.5e-7, so every log-prob figure sits at float32 rounding (2e-6 = 2-4 ulps);
    # grad norms come back as float64 JSON numbers and a CP sum differs from the CP=1 sum only in summation
    # order (~1e-15 relative): 1e-12.
    "float64": Limits(
        lp_mean=1e-6,
        lp_p99=2e-6,
        kl=1e-12,
        short_max=2e-6,
        window_ratio=4.0,
        window_floor=1e-6,
        loss_per_token=2e-6,
        grad_norm=1e-12,
        grad_norm_later=1e-10,
        post_mean=1e-6,
        post_p99=2e-6,
        post_loss_per_token=4e-6,
        sampler_k3=1e-12,
        sampler_max=2e-6,  # measured 0: decode and training forward in float64, both rounded to float32
    ),
    # float32: each CP layout sums attention blocks, GDN chunks and gradient partials in another order. Measured
    # (docs/validation.md): the tiny Qwen3.5 at CP 2/4 moves log-probs by mean 5e-8, p99 4.8e-7 (1 ulp at
    # |lp| ~ 4.6); SmolLM2-135M at CP 2 (30 layers, 49K vocabulary, |lp| up to ~20 where 1 ulp is 1.9e-6) by mean
    # 2.1e-6, p99 9.5e-6, short-row max 1.7e-5, per-token loss 4.9e-5 (importance sampling, whose ratio
    # exp(lp - q) amplifies both servers' q noise). Limits ~3-5x above the real model; the smallest fault (an
    # off-by-one position on one chunk) moves the mean by 4.6e-4. Windows skip their ratio test only below 2e-6
    # (float32 rounding of a log-prob), so a state drop that lifts a split window 100x over a quiet interior
    # still fails there. Step-1 grad norm: the brief's 1e-5 (measured 8e-9); later steps 1e-4 (measured 9e-7).
    "float32": Limits(
        lp_mean=1e-5,
        lp_p99=5e-5,
        kl=1e-10,
        short_max=5e-5,
        window_ratio=4.0,
        window_floor=2e-6,
        loss_per_token=2e-5,
        grad_norm=1e-5,
        grad_norm_later=1e-4,
        post_mean=2e-5,
        post_p99=1e-4,
        post_loss_per_token=2e-4,
        # sampler KL (docs/validation.md): tiny model 2-3e-14 at CP 1/2/4, SmolLM2-135M 9e-12; the off-by-one
        # fault 3.8e-6, the GDN state drop 4.4e-10 (2.9e-9 at a 512-token row budget). Max |Δ|: 9.5e-7 (1-2
        # ulps), SmolLM2 1.9e-5; the faults 1.6e-2 and 1.8e-4.
        sampler_k3=1e-10,
        sampler_max=1e-4,
    ),
    # bfloat16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per op): a different reduction order moves
    # hidden states and log-probs. Measured on the tiny Qwen3.5 at CP 2 and 4 (docs/validation.md): mean |Δlp|
    # 2.2e-4, p99 1.0e-3, short-row max 1.4e-3, per-token loss 1.8e-3 (cispo), step-1 grad norm 6e-4 relative,
    # later steps 1e-3. Limits ~5x above (KL, a square, 25x); the grad-norm limit 5e-3 is the 0.2-0.3% the
    # comparable system saw from layout changes on a 4B model, with headroom. The window ratio stays 4.
    "bfloat16": Limits(
        lp_mean=1e-3,
        lp_p99=5e-3,
        kl=1e-6,
        short_max=7e-3,
        window_ratio=4.0,
        window_floor=1e-3,
        loss_per_token=2e-3,
        grad_norm=5e-3,
        grad_norm_later=1e-2,
        post_mean=2e-3,
        post_p99=7e-3,
        post_loss_per_token=1e-2,
        sampler_k3=1e-6,  # measured 2e-9 at CP 1, 6e-8 at CP 2 (bf16 decode vs bf16 packed forward)
        sampler_max=7e-3,  # measured 6.7e-4 at CP 1, 1.2e-3 at CP 2: bf16 hidden states rounded in another order
    ),
}
# bf16-mixed computes the decoder layers in bfloat16 (ringtune.models.precision): a CP layout changes the same bf16
# roundings as in "bfloat16", so the same limits apply (not yet measured with the parity matrix).
LIMITS["bf16-mixed"] = LIMITS["bfloat16"]
_COARSENESS = ("float64", "float32", "bf16-mixed", "bfloat16")


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
    return max(a["layout"]["dtype"], b["layout"]["dtype"], key=_COARSENESS.index)


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
    pre = {name: _deltas(ra[name], rb[name]) for name in PRE_STEP}
    everything = np.abs(np.concatenate([d for name in PRE_STEP for d in pre[name]]))
    figures.append(Figure("lp.mean", _stat(everything, "mean"), limits.lp_mean))
    figures.append(Figure("lp.p99", _stat(everything, "p99"), limits.lp_p99))

    # Long rows of the starting-weight forwards: per-position classes under the window layout.
    long_abs, long_raw, rows = [], [], []
    for name in ("forward.main", "forward.long"):
        record = ra[name]
        positions = request_positions(record["lengths"], window_layout)
        for i, kind in enumerate(record["kinds"]):
            if kind in LONG_KINDS:
                delta = pre[name][i]
                rows.append((record["datums"][i], np.abs(delta), positions[i]))
                long_raw.append(delta)
                long_abs.append(np.abs(delta))
    raw = np.concatenate(long_raw)
    k3 = np.expm1(raw) - raw
    kept = k3[k3 <= np.percentile(k3, 99)]
    figures.append(Figure("lp.trimmed_kl", float(np.mean(kept)), limits.kl))

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

    for name in LOSS_RECORDS:
        x, y = ra[name], rb[name]
        per_token = max(abs(ly - lx) / n for lx, ly, n in zip(x["losses"], y["losses"], x["lengths"], strict=True))
        limit = limits.loss_per_token if name == "cross_entropy" else limits.post_loss_per_token
        figures.append(Figure(f"loss.{name}.per_token", per_token, limit))
    for step, gn_a in a["grad_norms"].items():
        gn_b = b["grad_norms"][step]
        value = abs(gn_b / gn_a - 1.0) if gn_a else abs(gn_b)
        limit = limits.grad_norm if step == "cross_entropy" else limits.grad_norm_later
        figures.append(Figure(f"grad_norm.{step}", value, limit, note=f"{gn_b:.10g} / {gn_a:.10g}"))
    for name in ("cross_entropy", *POST_STEP):
        d = np.abs(np.concatenate(_deltas(ra[name], rb[name])))
        pre_step = name == "cross_entropy"
        figures.append(Figure(f"lp.{name}.mean", _stat(d, "mean"), limits.lp_mean if pre_step else limits.post_mean))
        figures.append(Figure(f"lp.{name}.p99", _stat(d, "p99"), limits.lp_p99 if pre_step else limits.post_p99))

    figures += _sampler_figures(a.get("sampler_kl", {}), b.get("sampler_kl", {}), limits)

    deltas = [{"datum": datum, "abs": d, "boundaries": p.boundaries, "splits": p.splits} for datum, d, p in rows]
    return Comparison(
        reference=str(a.get("label")),
        candidate=str(b.get("label")),
        dtype="",
        layout=window_layout,
        figures=figures,
        deltas=deltas,
    )


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


def compare_dumps(a: Mapping[str, Any], b: Mapping[str, Any], noise: Mapping[str, Any] | None = None) -> Comparison:
    """B against reference A (and the noise run C against A, to widen the limits). Raises ComparisonRefusedError."""
    check_comparable(a, b)
    la, lb = Layout.from_dump(a["layout"]), Layout.from_dump(b["layout"])
    window_layout = lb if lb.cp_size >= la.cp_size else la
    dtype = _dtype(a, b)
    limits = LIMITS[dtype]
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
