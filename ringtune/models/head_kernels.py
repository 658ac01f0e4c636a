"""The log-prob head kernels by name, and the one place that picks one.

- ``tiled``: :func:`ringtune.models.logprob_head.label_logprobs`, ringtune's own tiled head (any device, any
  labels shape, the one-pass ``upstream`` path); the default everywhere.
- ``liger``: Liger-Kernel's fused linear cross-entropy (``liger_kernel.ops.fused_linear_cross_entropy``, Triton,
  CUDA only, an optional extra) with ``reduction="none"``: the per-token loss is ``-log p(label)``, so the
  log-prob is its negative. It applies only where the loss allows: one label per token (labels [T]), no
  ``upstream`` one-pass gradient, float32 log-probs of float32/bfloat16 inputs. A candidate: ``gpu_check.py``
  compares it with the float64 reference and times it against ``tiled``; it becomes a default only once an
  H200 run shows it faster at equal memory (docs/gpu.md). NOT YET RUN ON A GPU.

Selecting ``liger`` on CPU (outside Triton's interpreter, :mod:`ringtune.ops.triton_device`: the CPU suite runs it
there in float32, ``tests/triton_cpu/test_liger.py``), without the package, or for a call it cannot serve raises
ValueError naming why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringtune.models.logprob_head import IGNORE_INDEX, label_logprobs
from ringtune.ops.triton_device import installed, triton_runs_on


def liger_available() -> bool:
    """True when liger_kernel and triton are importable and CUDA is available (nothing is imported here)."""
    return torch.cuda.is_available() and installed("liger_kernel", "triton")


def liger_label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T + bias)[t, labels[t]]`` by Liger's fused linear cross-entropy.

    Args: hidden [T, D], weight [V, D], labels int64 [T] (``ignore_index``: log-prob 0, no gradient), bias [V]
    or None; CUDA tensors. Returns float32 [T]; differentiable in hidden, weight and bias.
    """
    check_liger(hidden.device, labels, None)
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels, bias, None, ignore_index, 0.0, 0.0, "none")
    loss = out[0] if isinstance(out, tuple) else out
    return -loss.float()


def check_liger(device: torch.device, labels: torch.Tensor, upstream: torch.Tensor | None) -> None:
    """ValueError unless the ``liger`` head can serve this call (CUDA or Triton's interpreter, installed, labels
    [T], no upstream)."""
    if not triton_runs_on(device):
        raise ValueError(
            f"head kernel 'liger' needs CUDA tensors; got device {device} (CPU only under TRITON_INTERPRET=1)"
        )
    if not installed("liger_kernel", "triton"):
        raise ValueError("head kernel 'liger' needs liger-kernel and triton (pip install 'ringtune[gpu]')")
    if labels.dim() != 1:
        raise ValueError(f"head kernel 'liger' takes one label per token (labels [T]); got {tuple(labels.shape)}")
    if upstream is not None:
        raise ValueError("head kernel 'liger' has no one-pass upstream gradient; use 'tiled'")


HEAD_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"tiled": label_logprobs, "liger": liger_label_logprobs}
"""The head kernels by name; the first is the default."""

DEFAULT_HEAD = next(iter(HEAD_KERNELS))


def select_head(
    device: torch.device, labels: torch.Tensor, upstream: torch.Tensor | None = None, name: str | None = None
) -> Callable[..., torch.Tensor]:
    """The head kernel: ``name`` if given (checked), else :data:`DEFAULT_HEAD` (``tiled``, on every device)."""
    name = DEFAULT_HEAD if name is None else name
    if name not in HEAD_KERNELS:
        raise ValueError(f"head kernel={name!r}: choose one of {', '.join(HEAD_KERNELS)}")
    if name == "liger":
        check_liger(device, labels, upstream)
    return HEAD_KERNELS[name]
