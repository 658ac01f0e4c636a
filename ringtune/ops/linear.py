"""The models' dense products ``x @ weightᵀ (+ bias)``, by kernel: the one place that picks it.

:data:`LINEAR_KERNELS` names the kernels; :func:`select_linear_kernel` picks one per call from the operands;
:class:`Linear` (an ``nn.Linear``, same parameters and names) runs :func:`linear`, which every decoder and vision
layer's projection uses, as do the MoE experts' CPU loop and the LoRA deltas (the MoE router stays on
``F.linear``: its top-k must match transformers' router bit for bit).

- ``aten``: ``F.linear`` (torch's BLAS, MKL on x86 CPUs; cuBLAS on CUDA): everything not below.
- ``onednn``: float32 on a CPU with oneDNN (``torch.ops.mkldnn._linear_pointwise``, plain strided tensors, no
  reorder): the forward and the input gradient ``d_y @ weight``; the weight gradient ``d_yᵀ @ x`` stays on
  aten. On this project's 2-core AMD EPYC (Zen 4) machine MKL's sgemm reached 110-160 GFLOPS on the packed-8K
  benchmark's layer shapes (8184 tokens; 256 → 768, 768 → 256, 256 → 512) where oneDNN reached 190-210 for
  the forward and the input gradient, while MKL was faster for the weight gradient (a long reduction over
  tokens: 150-190 against 105-170) (2 threads, ``_linear_pointwise`` against ``x @ wᵀ``). Both are float32
  products with float32 accumulation; their results differ by summation order only (~1e-6 relative).
Float64 (the CPU oracle), bfloat16 (mixed precision's layers), CUDA and tensor subclasses (FSDP's DTensors)
always take ``aten``.

:func:`product` is the same choice for a caller that writes its own backward: the log-prob head's
vocabulary-major logits ``w_block @ h_tileᵀ`` (a [32K, 256] weight block times 192 tokens: oneDNN 180-204 GFLOPS
against MKL's 150-165 on the same machine, with the tokens as oneDNN's small "weight" operand; the head's two
gradient products stay on aten, where oneDNN was slower for their strided operands: 72-129 against 162).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

LINEAR_KERNELS = ("aten", "onednn")


@functools.cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's dense linear for plain CPU tensors."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def select_linear_kernel(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``onednn`` for plain float32 CPU operands when oneDNN is there, else ``aten`` (the module docstring)."""
    if (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and _plain(x)
        and _plain(weight)
        and onednn_available()
    ):
        return "onednn"
    return "aten"


def _onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weightᵀ + bias`` for 2-D x [N, in], weight [out, in] (any strides) by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """``x @ weightᵀ + bias`` with x [N, in]: forward and d_x by oneDNN, d_weight by aten (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        d_x = _onednn_product(d_y, weight.t(), None) if ctx.needs_input_grad[0] else None
        d_weight = d_y.t() @ x if ctx.needs_input_grad[1] else None
        d_bias = d_y.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return d_x, d_weight, d_bias


def product_kernel(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The kernel :func:`product` runs for these operands: :func:`select_linear_kernel`'s, except ``aten`` for a
    product autograd would record (see there)."""
    recorded = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return "aten" if recorded else select_linear_kernel(x, weight)


def product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ`` for 2-D x [N, in] and weight [out, in] (any strides) by the kernel :func:`select_linear_kernel`
    picks, for callers that write their own backward (inside an ``autograd.Function``, under ``torch.no_grad``).
    oneDNN's op has no autograd formula (a backward through it silently gives no gradient), so a product that
    autograd would record takes ``aten``. ``out`` [N, out] (contiguous): written into on ``aten``; ``onednn``
    returns a new tensor, so use the result, not ``out``."""
    if product_kernel(x, weight) == "onednn":
        return _onednn_product(x, weight, None)
    if out is None:
        return x @ weight.T
    return torch.mm(x, weight.T, out=out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x [..., in], weight [out, in], bias [out] or None -> [..., out]) by the kernel
    :func:`select_linear_kernel` picks; the same contract and autograd as ``F.linear`` (once differentiable on
    ``onednn``)."""
    if select_linear_kernel(x, weight) == "aten" or (bias is not None and not _plain(bias)):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return _OneDnnLinear.apply(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and init) whose product is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
