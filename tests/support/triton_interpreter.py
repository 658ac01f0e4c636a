"""Run Triton kernels (fla, Liger) on CPU tensors under Triton's interpreter, for the CPU test suite.

``TRITON_INTERPRET=1`` makes ``triton.jit`` return an interpreted function that executes a kernel's body with NumPy
on CPU tensors. It must be set before Triton and any kernel module are imported (the decorator reads it, and
Triton's own ``tl.cumsum`` etc. are jit functions too), so
:func:`interpreted_kernels` sets it, imports the modules, and :func:`interpreter_session` keeps it set for as long as
a test module needs it (ringtune's kernel selection reads it too: :mod:`ringtune.ops.triton_device`).

Three limits of Triton 3.9's interpreter stop fla and Liger; each is worked around here by patching the
interpreter in this process (never site-packages), and only while a session is open:

1. the autotuner times its candidate configs through a GPU driver, which the interpreter has not: keep the first
   config (``Autotuner.prune_configs`` returns one, so nothing is timed);
2. a ``for i in range(n)`` loop variable is a Python int, where compiled Triton makes it a tensor (fla's
   ``chunk_delta_h`` calls ``i_t.to(tl.int64)``): the interpreter's AST rewrite rebinds the loop variable at the
   top of each iteration through its own ``to_tensor``, as it already does for every assignment;
3. a comparison's result is tagged int32 instead of int1, and a mask built from one is refused (fla's conv
   backward): comparisons are re-tagged int1.

bfloat16 is not emulated the way a GPU rounds it: run these tests in float32 only.

``fla.ops.cp`` (fla's context parallelism) refuses any device but an Ampere-or-newer NVIDIA GPU before it launches a
kernel; :func:`fla_cp_on_cpu` lets CPU tensors through that check while the interpreter is on (its other fix, the
all-gather output shape gloo refuses, is ringtune's own binding: ``ringtune.ops.gated_delta.cp_fla``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

INTERPRET_VARIABLE = "TRITON_INTERPRET"
TRITON_PIN = "3.9.0"
"""The Triton release these workarounds were written against (pyproject's ``triton-cpu`` extra pins it)."""

_INTERPRETED: set[str] = set()
"""Top-level packages (triton, fla, liger_kernel) first imported in this process inside a session."""


def missing_reason(*modules: str) -> str | None:
    """Why these kernels cannot run here (a module not installed, or one already imported uninterpreted), or None."""
    absent = [m for m in ("triton", *modules) if importlib.util.find_spec(m) is None]
    if absent:
        return (
            f"{', '.join(absent)} not installed (`make test` installs them in .venv/triton-cpu; "
            "tests/test_triton_cpu.py runs these tests with that folder on the path)"
        )
    compiled = [m for m in ("triton", *modules) if m in sys.modules and m not in _INTERPRETED]
    if compiled:
        return f"{', '.join(compiled)} already imported without {INTERPRET_VARIABLE}=1 in this process"
    return None


def _keep_first_config(original):
    def prune_configs(self, kwargs):
        return original(self, kwargs)[:1]

    return prune_configs


def _rebind_loop_variable(transformer: ast.NodeTransformer, node: ast.For) -> ast.For:
    node = transformer.generic_visit(node)
    if isinstance(node.target, ast.Name):
        name = node.target.id
        rebind = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load()))
        rebind = transformer.visit_Assign(ast.copy_location(rebind, node.body[0]))
        node.body.insert(0, ast.fix_missing_locations(rebind))
    return node


def _comparisons_as_int1(original):
    def compare(self, lhs, rhs):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        out = original(self, lhs, rhs)  # tagged with the operands' dtype, its booleans cast to it
        return TensorHandle(out.data.astype(bool), tl.int1)

    return compare


@contextmanager
def interpreter_session() -> Iterator[None]:
    """Within: ``TRITON_INTERPRET=1`` and the three workarounds; the environment and Triton restored on exit.

    Kernel modules imported inside stay interpreted for the rest of the process (they are cached by Python).
    """
    if "triton" in sys.modules and "triton" not in _INTERPRETED:
        raise RuntimeError(f"triton was imported without {INTERPRET_VARIABLE}=1 in this process: {missing_reason()}")
    saved_env = os.environ.get(INTERPRET_VARIABLE)
    os.environ[INTERPRET_VARIABLE] = "1"  # before Triton itself is imported: its own library is jit-decorated too
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    _INTERPRETED.add("triton")
    builder = interpreter.InterpreterBuilder
    compares = [n for n in vars(builder) if n.startswith("create_icmp") or n.startswith("create_fcmp")]
    saved = {
        "prune": autotuner.Autotuner.prune_configs,
        "for": interpreter.ASTTransformer.__dict__.get("visit_For"),
        "compares": {n: getattr(builder, n) for n in compares},
    }
    autotuner.Autotuner.prune_configs = _keep_first_config(saved["prune"])
    interpreter.ASTTransformer.visit_For = _rebind_loop_variable
    for name, fn in saved["compares"].items():
        setattr(builder, name, _comparisons_as_int1(fn))
    try:
        yield
    finally:
        autotuner.Autotuner.prune_configs = saved["prune"]
        if saved["for"] is None:
            del interpreter.ASTTransformer.visit_For
        else:
            interpreter.ASTTransformer.visit_For = saved["for"]
        for name, fn in saved["compares"].items():
            setattr(builder, name, fn)
        if saved_env is None:
            os.environ.pop(INTERPRET_VARIABLE, None)
        else:
            os.environ[INTERPRET_VARIABLE] = saved_env


def interpreted_kernels(*names: str) -> list[ModuleType]:
    """Import the modules ``names`` (call inside :func:`interpreter_session`); their kernels are interpreted."""
    if os.environ.get(INTERPRET_VARIABLE) != "1":
        raise RuntimeError(f"import kernels inside interpreter_session(), with {INTERPRET_VARIABLE}=1")
    for name in names:
        top = name.split(".")[0]
        if top in sys.modules and top not in _INTERPRETED:
            raise RuntimeError(f"{top} was imported without {INTERPRET_VARIABLE}=1 in this process")
        _INTERPRETED.add(top)
    return [importlib.import_module(name) for name in names]


FLA_CP_DEVICE_CHECKERS = (
    "fla.ops.cp.chunk_delta_h",
    "fla.ops.cp.chunk_fwd",
    "fla.ops.cp.chunk_bwd",
    "fla.ops.cp.chunk_merge",
)
"""The fla 0.6.0 modules that call ``fla.ops.cp.context._check_cp_device`` by a name of their own."""


@contextmanager
def fla_cp_on_cpu() -> Iterator[None]:
    """Within (and inside :func:`interpreter_session`): fla.ops.cp's device check passes CPU tensors; undone on exit.

    CUDA tensors still get fla's own check; only CPU ones under the interpreter are let through.
    """
    if os.environ.get(INTERPRET_VARIABLE) != "1":
        raise RuntimeError(f"fla_cp_on_cpu() runs inside interpreter_session(), with {INTERPRET_VARIABLE}=1")
    modules = interpreted_kernels(*FLA_CP_DEVICE_CHECKERS)
    original = modules[0]._check_cp_device

    def check_cp_device(device) -> None:
        if device.type != "cpu":
            original(device)

    for module in modules:
        module._check_cp_device = check_cp_device
    try:
        yield
    finally:
        for module in modules:
            module._check_cp_device = original
