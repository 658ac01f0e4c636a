"""Where ringtune's optional Triton kernels (fla's GatedDeltaNet scan and conv, Liger's head) may run.

On CUDA tensors, and on CPU tensors while Triton's own interpreter is on (``TRITON_INTERPRET=1``, Triton's switch,
read here, never set): the interpreter executes a kernel's body with NumPy, which is how the CPU suite runs these
kernels against ringtune's float64 references (``tests/support/triton_interpreter.py``, ``tests/triton_cpu``).
Only an explicit selection can reach them on CPU: every default (``default_chunk_scan``, ``select_conv``,
``select_head``) still asks for CUDA, so the CPU path stays ringtune's own kernels whatever is installed.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_interpreting() -> bool:
    """True while Triton's interpreter is on (``TRITON_INTERPRET`` set to anything but empty / ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def installed(*modules: str) -> bool:
    """True when every module in ``modules`` can be imported (nothing is imported here)."""
    return all(importlib.util.find_spec(name) is not None for name in modules)


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel may be launched on ``device``: CUDA, or CPU under Triton's interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreting())
