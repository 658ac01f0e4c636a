"""Causal depthwise conv1d over a packed THD row (Qwen3.5's short conv on q/k/v), reset at ``cu_seqlens``.

For channel ``c`` and token ``t`` at position ``l`` of its sequence ``i`` (kernel size K):

    out[t, c] = act(bias[c] + Σ_{j<K} weight[c, j] · x_i[l − (K−1) + j, c])

where ``x_i[p]`` for ``p < 0`` is ``initial_context[i, K−1+p]`` (the K−1 inputs that precede the
sequence, e.g. the previous CP rank's last tokens) or zero: nothing leaks across a boundary. This is
transformers' ``causal_conv1d_fn`` (``F.conv1d`` with ``padding=K−1``, cut to length) per sequence.
Both versions compute in float32 (float64 for float64 input) and return ``x.dtype``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ringtune.ops.gated_delta.conv_taps import taps_causal_conv1d
from ringtune.ops.gated_delta.fla_kernels import fla_available, fla_causal_conv1d
from ringtune.ops.gated_delta.inputs import check_cu_seqlens, compute_dtype

ACTIVATIONS = ("silu", None)


def _check_conv_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    initial_context: torch.Tensor | None,
) -> list[int]:
    if x.dim() != 2:
        raise ValueError(f"x must have shape [T, channels]; got {tuple(x.shape)}")
    D = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [channels, K] = [{D}, K]; got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"bias must have shape [channels] = [{D}]; got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    bounds = check_cu_seqlens(cu_seqlens, x.shape[0])
    n, K = len(bounds) - 1, weight.shape[1]
    if initial_context is not None and initial_context.shape != (n, K - 1, D):
        raise ValueError(
            f"initial_context must have shape [n, K-1, channels] = {[n, K - 1, D]}; got {tuple(initial_context.shape)}"
        )
    return bounds


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(out) if activation == "silu" else out


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: one ``F.conv1d`` per sequence over ``[context ++ sequence]``; contract as :func:`causal_conv1d`."""
    bounds = _check_conv_inputs(x, weight, cu_seqlens, bias, activation, initial_context)
    acc = compute_dtype(x.dtype)
    D, K = weight.shape
    w, b = weight.to(acc).unsqueeze(1), None if bias is None else bias.to(acc)
    outs = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end == start:  # an empty sequence has no output (and F.conv1d refuses a window longer than its input)
            continue
        ctx = x.new_zeros(K - 1, D, dtype=acc) if initial_context is None else initial_context[i].to(acc)
        seq = torch.cat([ctx, x[start:end].to(acc)])  # [K-1+L, D]
        outs.append(F.conv1d(seq.t().unsqueeze(0), w, b, groups=D)[0].t())
    out = torch.cat(outs) if outs else x.new_zeros(0, D, dtype=acc)
    return _activate(out, activation).to(x.dtype)


def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d of a packed row in plain torch (the ``torch`` entry of :data:`CONV_KERNELS`).

    K shifted multiply-adds over the row with each sequence's K−1 context rows (or zeros) written in front of
    it, and a hand-written backward (``conv_taps.py``: why not ``F.conv1d``, and what it keeps).

    Args:
        x: [T, channels] (e.g. the concatenated q/k/v projections, ``channels = 2·Hk·Dk + Hv·Dv``).
        weight: [channels, K] (``nn.Conv1d.weight`` [channels, 1, K] squeezed); bias: [channels] or None.
        cu_seqlens: int64 [n+1] sequence boundaries (0 first, T last).
        activation: ``"silu"`` (Qwen3.5) or None.
        initial_context: [n, K−1, channels], the K−1 inputs before each sequence in order (row K−2 is the
            token just before it); zeros if None.
    Returns:
        [T, channels] in ``x.dtype``. Differentiable (x, weight, bias, initial_context).
    """
    bounds = _check_conv_inputs(x, weight, cu_seqlens, bias, activation, initial_context)
    if x.shape[0] == 0:  # an empty row; keep the graph so weight gets a zero gradient
        return x[:0] * weight[:, 0].to(x.dtype)
    out = taps_causal_conv1d(
        x,
        weight,
        bounds,
        bias=bias,
        silu=activation == "silu",
        initial_context=initial_context,
        dtype=compute_dtype(x.dtype),
    )
    return out.to(x.dtype)


def _fla_conv(x, weight, cu_seqlens, *, bias=None, activation="silu", initial_context=None):
    if initial_context is not None:
        raise ValueError("the fla conv kernel takes no initial_context (the CP conv halo): use kernel='torch'")
    _check_conv_inputs(x, weight, cu_seqlens, bias, activation, None)
    return fla_causal_conv1d(x, weight, cu_seqlens, bias=bias, activation=activation)


CONV_KERNELS = {"torch": torch_causal_conv1d, "fla": _fla_conv}
"""The conv kernels by name, one contract (:func:`causal_conv1d`): ``torch`` (any device, the CPU default, and the
only one taking ``initial_context``) and ``fla`` (flash-linear-attention's Triton kernel, CUDA only, optional
extra; not yet run on a GPU)."""


def select_conv(device: torch.device, with_context: bool, name: str | None = None) -> str:
    """The conv kernel's name: ``name`` if given, else ``fla`` on CUDA with fla and no context, else ``torch``."""
    if name is not None:
        if name not in CONV_KERNELS:
            raise ValueError(f"conv kernel={name!r}: choose one of {', '.join(CONV_KERNELS)}")
        return name
    return "fla" if device.type == "cuda" and not with_context and fla_available() else "torch"


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_context: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d of a packed row, each sequence on its own (see the module docstring), by the kernel
    :func:`select_conv` picks (``kernel`` forces one of :data:`CONV_KERNELS`); arguments and result as
    :func:`torch_causal_conv1d`."""
    name = select_conv(x.device, initial_context is not None, kernel)
    fn = CONV_KERNELS[name]
    return fn(x, weight, cu_seqlens, bias=bias, activation=activation, initial_context=initial_context)
