"""What ``ringtune parity matrix`` serves (:class:`MatrixConfig`) and what it found (:class:`MatrixReport` of
:class:`MatrixRow`): plain records shared by the matrix runner (:mod:`ringtune.parity.matrix`) and the report
writer (:mod:`ringtune.parity.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtune.parity.compare import Comparison
from ringtune.parity.servers import ServeSpec


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
        faults: debug faults to serve, each at its :data:`~ringtune.parity.matrix.FAULT_LAYOUTS` layout; each
            must fail compare against the CP=1 reference of its dtype (served for the faults if ``dtypes`` lacks it).
        moe_layouts: (DP, CP, EP) layouts of a tiny Qwen3.5-MoE (routers that differ per token), each compared
            with its own DP=1, CP=1, EP=1 reference in every dtype of ``dtypes``; empty = skip it.
        option_layouts: :class:`ServeSpec` options of the tiny Qwen3.5 (:data:`~ringtune.parity.matrix.OPTIONS_DEFAULT`,
            :func:`~ringtune.parity.matrix.options_full`), each at ``row_tokens / cp`` per rank against its
            :meth:`ServeSpec.reference`.
        noise_json: the measured noise floors (``ringtune parity noise --out``) the report shows, if the file is
            there.
        long_context: cap of the long datums (None: the servers' context length).
        reuse: take a layout's dump from ``workdir`` when it is there already (re-compare without serving).
        slice: (I, N): serve and compare only part I of N contiguous parts of the planned comparisons
            (:func:`~ringtune.parity.matrix.slice_of`); (1, 1) is the whole matrix.
        slices_json: the record of the ``--full`` slices run (:mod:`ringtune.parity.slices`): a sliced run adds
            its tally there, and the report shows the record, if the file is there.
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
    option_layouts: tuple[dict[str, Any], ...] = ()
    noise_json: Path | None = None
    long_context: int | None = None
    seed: int = 0
    reuse: bool = False
    slice: tuple[int, int] = (1, 1)
    slices_json: Path | None = None


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
    served: list[str] = field(default_factory=list)  # the servers started (a reused dump starts none)
    server_seconds: dict[str, float] = field(default_factory=dict)  # each started server: served, ran, stopped
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)
