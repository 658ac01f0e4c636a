"""fla's and Liger's Triton kernels on CPU tensors under Triton's interpreter, in a process of their own.

The kernels' packages live outside the test venv's site-packages (``make test`` installs the pinned
``triton-cpu`` set with ``pip install --target .venv/triton-cpu``): transformers' Qwen3.5 picks fla's kernels for
its GatedDeltaNet whenever ``fla`` can be imported, whatever the device, so fla importable in this process would
change the transformers reference every model test compares against. The tests of ``tests/triton_cpu/`` therefore
run in a child pytest whose ``PYTHONPATH`` adds that folder (``TRITON_INTERPRET=1`` is set there, before Triton is
imported, by ``support.triton_interpreter``). Skipped, with the reason, where the folder is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
KERNEL_SITE = Path(sys.prefix) / "triton-cpu"
"""Where ``make test`` installs triton, fla, Liger and einops (``--target``)."""


@pytest.mark.skipif(
    not (KERNEL_SITE / "triton").is_dir(), reason=f"{KERNEL_SITE} missing: run `make test` (installs it)"
)
def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(KERNEL_SITE), str(TESTS.parent), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-o", "addopts=-ra", "-p", "no:cacheprovider"]
    child = subprocess.run(
        [*command, str(TESTS / "triton_cpu")], env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1500
    )
    print(child.stdout[-6000:])
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout.splitlines()[-1] and "skipped" not in child.stdout.splitlines()[-1]
