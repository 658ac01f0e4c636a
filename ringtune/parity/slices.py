"""``ringtune parity matrix --full --slice I/N``: the record of the slices run, so that the product of the options
(too long for one sitting on a CPU machine) can be served in parts, on several days or machines, and the report
still says what ran.

A sliced run serves part I of N of the planned comparisons (:func:`~ringtune.parity.matrix.slice_of`), taking
every dump already in ``--workdir`` (the references a previous slice served, its own layouts when rerun), and adds
one entry to the record (JSON, ``docs/validation/full-slices.json`` by default): the slice, the date, its layouts
and how many were as expected, the servers it started and its wall time. :func:`slices_section` is the report's
table of that record (docs/validation.md).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from ringtune.parity.matrix_types import MatrixReport


def parse_slice(text: str) -> tuple[int, int]:
    """``"I/N"`` as (I, N); ValueError unless both are integers with 1 <= I <= N."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--slice {text!r}: expected I/N, e.g. 2/8")
    index, count = int(parts[0]), int(parts[1])
    if not 1 <= index <= count:
        raise ValueError(f"--slice {text!r}: want 1 <= I <= N")
    return index, count


def slice_entry(report: MatrixReport, index: int, count: int, planned: int) -> dict[str, Any]:
    """The record's entry of one sliced run: ``planned`` comparisons in the whole matrix, the slice's rows."""
    return {
        "slice": f"{index}/{count}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "planned": planned,
        "layouts": len(report.rows),
        "as_expected": sum(r.ok for r in report.rows),
        "not_as_expected": [f"{r.model} {r.spec.name}" for r in report.rows if not r.ok],
        "faults": sum(r.expect_fail for r in report.rows),
        "servers_started": len(report.served),
        "wall_seconds": round(report.wall_seconds, 1),
    }


def record_slice(path: Path, entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Add (or replace: a slice run again) ``entry`` in the record at ``path``; returns the whole record."""
    record: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else {}
    record[entry["slice"]] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True))
    return record


def slices_section(path: Path | None) -> list[str]:
    """The report's section on the ``--full`` slices run (the record at ``path``), or nothing without one."""
    if path is None or not path.is_file():
        return []
    record: dict[str, dict[str, Any]] = json.loads(path.read_text())
    entries = sorted(record.values(), key=lambda e: tuple(int(x) for x in e["slice"].split("/"))[::-1])
    planned = max((e["planned"] for e in entries), default=0)
    layouts = sum(e["layouts"] for e in entries)
    expected = sum(e["as_expected"] for e in entries)
    wall = sum(e["wall_seconds"] for e in entries)
    lines = [
        "",
        "## `--full` in slices (`ringtune parity matrix --full --slice I/N`)",
        "",
        f"{layouts} of the {planned} comparisons of `--full` ran ({expected} as expected: clean layouts pass, faults",
        f"fail compare), in {len(entries)} slices, {wall:.0f} s of wall time. Source: `{path.name}`.",
        "",
        "| slice | date | layouts | as expected | faults | servers started | wall s | not as expected |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        bad = ", ".join(e["not_as_expected"]) or "none"
        lines.append(
            f"| {e['slice']} | {e['date']} | {e['layouts']} | {e['as_expected']} | {e['faults']} "
            f"| {e['servers_started']} | {e['wall_seconds']:.0f} | {bad} |"
        )
    return lines
