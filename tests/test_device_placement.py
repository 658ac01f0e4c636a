"""Device authority guard (docs/gpu.md "Device placement"): every tensor the package creates says where it lives.

A CPU machine cannot see a tensor made on the wrong device, so this guard reads the source instead: every call of a
torch tensor factory (``torch.zeros``, ``torch.arange``, ``torch.tensor``, ...) in ``ringtune/`` passes ``device=``:
the device of the tensors it works with, or ``device="cpu"`` on purpose (request values, seeded CPU generators,
index math sliced before it moves). ``*_like`` factories and ``x.new_*`` take a tensor's device and are fine. Two
exemptions: ``ringtune/layout`` (pure host index math whose results the callers move) and a factory inside
``nn.Parameter(...)`` (a module's parameters are made under the loader's ``torch.device`` context, ``meta`` when a
checkpoint is read, and then assigned on the rank's device).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import torch.distributed as dist

from ringtune.parallel.collectives import all_reduce_, group_device_error

PACKAGE = Path(__file__).resolve().parents[1] / "ringtune"
FACTORIES = frozenset(
    {
        "zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "randn", "rand", "randint", "randperm",
        "eye", "linspace", "logspace", "empty_strided", "tril_indices", "triu_indices", "scalar_tensor",
    }
)  # fmt: skip
EXEMPT_DIRS = ("layout",)


def _is_factory(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FACTORIES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def _parameter_arguments(tree: ast.AST) -> set[int]:
    """ids of every node inside the arguments of an ``nn.Parameter(...)`` call."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Parameter":
            for arg in node.args:
                inside.update(id(n) for n in ast.walk(arg))
    return inside


def factory_calls_without_device(root: Path) -> list[str]:
    """``path:line: torch.name`` for every torch factory call under ``root`` (minus :data:`EXEMPT_DIRS` and
    parameters' initial values) that passes no ``device=`` keyword."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in EXEMPT_DIRS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        parameters = _parameter_arguments(tree)
        for node in ast.walk(tree):
            if _is_factory(node) and id(node) not in parameters:
                assert isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                if not any(k.arg == "device" for k in node.keywords):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: torch.{node.func.attr}")
    return found


def test_every_tensor_factory_names_its_device():
    missing = factory_calls_without_device(PACKAGE)
    assert not missing, "tensor factories without device= (pass the tensors' device, or 'cpu' on purpose):\n" + (
        "\n".join(missing)
    )


def test_the_guard_catches_a_planted_factory_call(tmp_path: Path):
    """Negative control: a copy of the package with one factory call lacking ``device=`` fails the guard, and one
    inside an ``nn.Parameter`` does not."""
    copy = tmp_path / "ringtune"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert factory_calls_without_device(copy) == []
    target = copy / "engine" / "gradients.py"
    text = target.read_text()
    target.write_text(text + "\n\ndef planted():\n    return torch.zeros(3)\n")
    line = len((text + "\n\ndef planted():\n").splitlines()) + 1
    assert factory_calls_without_device(copy) == [f"ringtune/engine/gradients.py:{line}: torch.zeros"]
    target.write_text(text + "\n\ndef planted():\n    return torch.nn.Parameter(torch.zeros(3))\n")
    assert factory_calls_without_device(copy) == []


def test_exempt_folders_are_pure_index_math():
    """The exempt folders import no torch.distributed (their tensors are host index math)."""
    for folder in EXEMPT_DIRS:
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                assert not any(n.startswith("torch.distributed") for n in names), path


def test_the_group_device_rule():
    """NCCL never takes a CPU tensor; gloo takes CPU tensors and CUDA ones it stages through host memory; a device
    no backend moves (``meta``) is refused by name (pure rule: a CPU machine has no NCCL group to try it on)."""
    assert group_device_error("cpu", "gloo") is None
    assert group_device_error("cuda", "gloo") is None  # host-staged (ranks sharing a GPU)
    assert group_device_error("cuda", "nccl") is None
    assert "a cpu tensor on a nccl group" in (group_device_error("cpu", "nccl") or "")
    assert "a meta tensor on a gloo group" in (group_device_error("meta", "gloo") or "")


def test_a_collective_refuses_a_tensor_its_group_cannot_move(tmp_path: Path):
    """Every collective of ``parallel/collectives.py`` checks the rule before it communicates (a one-rank gloo
    world: a ``meta`` tensor is refused with the rule's message, a CPU one passes)."""
    import torch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        assert all_reduce_(torch.ones(2, device="cpu"), group).tolist() == [1.0, 1.0]
        try:
            all_reduce_(torch.ones(2, device="meta"), group)
        except ValueError as exc:
            assert "a meta tensor on a gloo group" in str(exc)
        else:
            raise AssertionError("a meta tensor reached a gloo collective")
    finally:
        dist.destroy_process_group()
