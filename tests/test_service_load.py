"""``benchmarks/service_load.py --quick``: 8 SDK clients on one ``ringtune serve --cp 2``; every check passes
(every future resolves, no 5xx, each run's losses equal its replay alone bit for bit, fairness)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def test_service_load_quick(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "service_load.py"
    spec = importlib.util.spec_from_file_location("service_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    code = module.main(["--quick"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "futures: " in out and ", 0 failed" in out and "bit for bit: PASS" in out, out
