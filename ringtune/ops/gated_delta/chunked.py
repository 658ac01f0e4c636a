"""Chunked gated delta rule over one packed THD row (WY representation / UT transform), plain torch.

Same contract as :func:`ringtune.ops.gated_delta.naive.naive_gated_delta_rule`; the math is in
``chunk_scan.py``. Three scans compute it, with one signature and the same values; :data:`CHUNK_SCANS`
is the one place that names them and :func:`default_chunk_scan` the one place that picks by device (every
caller, single process and both CP modes, goes through :func:`chunk_gated_delta_rule` or :func:`chunk_scan_fn`;
``scan=None`` means the device's default).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringtune.ops.gated_delta.chunk_scan import CHUNK_SIZE, gated_delta_chunk_scan
from ringtune.ops.gated_delta.chunk_scan_recompute import recomputing_chunk_scan
from ringtune.ops.gated_delta.fla_kernels import fla_available, fla_chunk_scan
from ringtune.ops.gated_delta.inputs import check_gated_delta_inputs, prepare_gated_delta_inputs

CHUNK_SCANS: dict[str, Callable] = {
    "recompute": recomputing_chunk_scan,
    "autograd": gated_delta_chunk_scan,
    "fla": fla_chunk_scan,
}
"""The chunked scans by name, the first the CPU default:

- ``recompute`` (``chunk_scan_recompute.py``): keeps its inputs and a few segment start states; the backward
  reruns the scan segment by segment (fla's kernels also keep only inputs): 3.1 KiB per token at 4 heads of
  64 in float32, and the benchmark model's GDN layer 15.1 KiB (docs/gated_delta.md).
- ``autograd`` (``chunk_scan.py``): autograd keeps every intermediate: 19.1 KiB per token there, the layer
  32.2 KiB; kept as the plain reference of the other and for comparisons (benchmarks/gated_delta_memory.py).
- ``fla`` (``fla_kernels.py``): flash-linear-attention's Triton kernel, CUDA only, an optional extra; the CUDA
  default when installed (docs/gpu.md). Not yet run on a GPU.
"""

DEFAULT_CHUNK_SCAN = next(iter(CHUNK_SCANS))
"""The default scan on CPU (and on CUDA without fla); what the memory planner assumes."""


def default_chunk_scan(device: torch.device) -> str:
    """The scan a ``scan=None`` caller gets on ``device``: ``fla`` on CUDA when it is installed, else the CPU one."""
    return "fla" if device.type == "cuda" and fla_available() else DEFAULT_CHUNK_SCAN


def chunk_scan_fn(name: str | None = DEFAULT_CHUNK_SCAN, device: torch.device | None = None) -> Callable:
    """The scan called ``name`` (None: :func:`default_chunk_scan` of ``device``, CPU if None):
    ``fn(q, k, v, g, beta, bounds, initial_state, *, chunk_size, output_final_state)``."""
    if name is None:
        name = default_chunk_scan(device or torch.device("cpu"))
    if name not in CHUNK_SCANS:
        raise ValueError(f"scan={name!r}: choose one of {', '.join(CHUNK_SCANS)}")
    return CHUNK_SCANS[name]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = CHUNK_SIZE,
    output_final_state: bool = True,
    scan: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a packed row whose state resets at ``cu_seqlens``, chunk by chunk.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv], one float dtype (Hv a multiple of Hk: grouped value heads,
            value head ``h`` reads key head ``h // (Hv // Hk)``).
        cu_seqlens: int64 [n+1] sequence boundaries (0 first, T last; empty sequences allowed).
        g: [T, Hv] log decay (≤ 0), keyword-only; beta: [T, Hv] write strength in (0, 1), keyword-only.
        initial_state: [n, Hv, Dk, Dv], the state each sequence starts from (zeros if None).
        scale: multiplies q, default ``Dk ** -0.5``.
        use_qk_l2norm: L2-normalise q and k (in the compute dtype) first, as fla's ``use_qk_l2norm_in_kernel``.
        chunk_size: tokens per chunk (64 as fla and transformers).
        output_final_state: False returns None instead of the final states (saves [n, Hv, Dk, Dv] of memory,
            which for a row of many documents is large: the model's forward needs no state).
        scan: a name of :data:`CHUNK_SCANS` (what the backward keeps; same values), or None: the device's
            default (:func:`default_chunk_scan`).
    Returns:
        ``(o [T, Hv, Dv] in q.dtype, final_state [n, Hv, Dk, Dv])``; computed and the state returned in float32
        (float64 for float64 inputs); ``final_state[i]`` is the state after the last token of sequence ``i``
        (``initial_state[i]`` for an empty one). Differentiable by autograd with respect to every tensor argument.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    fn = chunk_scan_fn(scan, q.device)
    bounds = check_gated_delta_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_gated_delta_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    o, final = fn(q, k, v, g, beta, bounds, initial_state, chunk_size=chunk_size, output_final_state=output_final_state)
    assert o is not None
    return o.to(out_dtype), final
