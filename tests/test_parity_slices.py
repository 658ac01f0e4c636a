"""``ringtune parity matrix --full --slice I/N`` without servers: the plan of comparisons (each layout once, against
the reference ``ServeSpec.reference()`` names), its contiguous slices (together the whole plan, each comparison in
exactly one), the ``I/N`` argument, and the record of the slices run that the report shows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringtune.debug_faults import DEBUG_FAULTS
from ringtune.parity.matrix import (
    MOE_DEFAULT,
    MOE_FULL,
    OPTIONS_DEFAULT,
    MatrixConfig,
    options_full,
    plan_matrix,
    slice_of,
)
from ringtune.parity.matrix_types import MatrixReport
from ringtune.parity.slices import parse_slice, record_slice, slice_entry, slices_section


def _config(tmp: Path, **kw) -> MatrixConfig:
    return MatrixConfig(workdir=tmp, doc=tmp / "v.md", png_dir=tmp / "png", **kw)


def _full(tmp: Path) -> MatrixConfig:
    return _config(
        tmp,
        dps=(1, 2),
        dtypes=("float32", "bfloat16", "float64"),
        embedded_cps=(1, 2),
        faults=tuple(DEBUG_FAULTS),
        moe_layouts=MOE_FULL,
        option_layouts=options_full(),
    )


def test_the_plan_holds_each_layout_once_against_its_reference(tmp_path):
    default = plan_matrix(
        _config(tmp_path, dtypes=("float32",), moe_layouts=MOE_DEFAULT, option_layouts=OPTIONS_DEFAULT),
        tiny="t",
        moe_tiny="m",
    )
    # the float32 grid (CP 2/4 x 2 modes), the MoE at CP2 EP2, the 9 option layouts: 14 candidates, 6 references
    assert len(default) == 14 and len({(p.tag, p.reference.name) for p in default}) == 6
    full = plan_matrix(_full(tmp_path), tiny="t", moe_tiny="m")
    names = [(p.tag, p.spec.name) for p in full]
    assert len(names) == len(set(names))
    assert sum(p.expect_fail for p in full) == len(DEBUG_FAULTS)
    for p in full:
        assert p.reference.cp == 1 and p.reference.dp == 1 and p.reference.debug_fault is None
        assert p.reference.dtype == p.spec.dtype and p.reference.long_rows == p.spec.long_rows
        assert p.reference.max_tokens_per_rank == p.spec.max_tokens_per_rank * p.spec.cp
        if p.tag == "tiny-qwen3.5":
            assert p.reference == p.spec.reference()


@pytest.mark.parametrize("count", [1, 3, 8, 200])
def test_slices_cover_the_plan_once_in_order(tmp_path, count):
    full = plan_matrix(_full(tmp_path), tiny="t", moe_tiny="m")
    parts = [slice_of(full, i, count) for i in range(1, count + 1)]
    assert [p for part in parts for p in part] == full
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="1 <= I <= N"):
        slice_of(full, count + 1, count)


def test_the_slice_argument():
    assert parse_slice("2/8") == (2, 8) and parse_slice("1/1") == (1, 1)
    for bad in ("0/3", "4/3", "2", "a/b", "1/2/3"):
        with pytest.raises(ValueError, match="--slice"):
            parse_slice(bad)


def test_the_record_of_slices_and_its_section(tmp_path):
    path = tmp_path / "full-slices.json"
    assert slices_section(path) == [] and slices_section(None) == []

    def row(ok: bool, fault: bool = False):
        return SimpleNamespace(ok=ok, expect_fail=fault, model="tiny", spec=SimpleNamespace(name="cp2-x"))

    report = MatrixReport(rows=[row(True), row(True, fault=True), row(False)], served=["a", "b"], wall_seconds=61.2)
    record_slice(path, slice_entry(report, 2, 8, planned=135))
    entry = json.loads(path.read_text())["2/8"]
    assert (entry["layouts"], entry["as_expected"], entry["faults"], entry["servers_started"]) == (3, 2, 1, 2)
    assert entry["not_as_expected"] == ["tiny cp2-x"] and entry["planned"] == 135
    clean = MatrixReport(rows=[row(True)], served=[], wall_seconds=5.0)
    record_slice(path, slice_entry(clean, 1, 8, planned=135))
    record_slice(path, slice_entry(clean, 2, 8, planned=135))  # slice 2 run again: replaces its entry
    text = "\n".join(slices_section(path))
    assert "2 of the 135 comparisons" in text and "(2 as expected" in text and "in 2 slices, 10 s" in text
    assert text.index("| 1/8 |") < text.index("| 2/8 |")
