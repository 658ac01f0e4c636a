"""GatedDeltaNet kernels from flash-linear-attention (fla, Triton) for CUDA, behind ringtune's registries.

``fla`` is an optional extra (``pip install 'ringtune[gpu]'``, docs/gpu.md): it is imported lazily inside each
function, never at module import, so the CPU install (no Triton, no fla) imports this file and the registries
name its kernels without loading them. Selecting one on CPU (outside Triton's interpreter, see
:mod:`ringtune.ops.triton_device`), or without fla installed, raises :class:`FlaUnavailableError` (a RuntimeError)
naming the reason.

- :func:`fla_chunk_scan`: a scan of :data:`ringtune.ops.gated_delta.chunked.CHUNK_SCANS` (same signature as
  ``recomputing_chunk_scan``): ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` over the packed row as one
  batch with ``cu_seqlens``, ``initial_state`` and ``output_final_state``. Its inputs come prepared (float32,
  key heads expanded, q scaled and L2-normed), so fla is called with ``scale=1`` and no in-kernel norm; like
  ringtune's recompute scan it keeps only its inputs and recomputes in the backward.
- :func:`fla_causal_conv1d`: ``fla.modules.causal_conv1d.causal_conv1d`` (Triton backend) with ``cu_seqlens``,
  for the row without a CP conv context (the context path keeps ringtune's conv, whose context gradient the
  chunkwise CP mode needs; fla's ``initial_state`` gradient is not relied on).

fla's own context parallelism (``fla.ops.cp``) is the ``fla_cp`` CP mode (``cp_fla.py``, docs/gpu.md).
NOT YET RUN ON A GPU: benchmarks/gpu_check.py compares both kernels with the float64 CPU reference when a GPU
is at hand; the CPU suite runs both under Triton's interpreter in float32 (``tests/triton_cpu/test_fla.py``, with
the ``triton-cpu`` extra) against the float64 references.
"""

from __future__ import annotations

import torch

from ringtune.ops.triton_device import installed, triton_runs_on

FLA_CHUNK_SIZE = 64
"""fla's chunked kernels work in chunks of 64 tokens (ringtune's scans take any chunk size)."""


class FlaUnavailableError(RuntimeError):
    """An fla kernel was selected where it cannot run (no CUDA tensor outside Triton's interpreter, or fla / Triton
    not installed)."""


def fla_available() -> bool:
    """True when ``fla`` and ``triton`` can be imported and CUDA is available (nothing is imported here)."""
    return torch.cuda.is_available() and installed("fla", "triton")


def require_fla(device: torch.device, what: str) -> None:
    """FlaUnavailableError naming ``what`` unless fla's kernels can run on ``device`` (CUDA, or CPU under Triton's
    interpreter) and fla and triton are installed."""
    if not triton_runs_on(device):
        raise FlaUnavailableError(
            f"{what} needs CUDA tensors; got device {device} (CPU uses ringtune's kernel; fla runs on CPU only "
            "under Triton's interpreter, TRITON_INTERPRET=1)"
        )
    if not installed("fla", "triton"):
        raise FlaUnavailableError(
            f"{what} needs flash-linear-attention and triton (pip install 'ringtune[gpu]', docs/gpu.md)"
        )


def fla_chunk_scan(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: list[int],
    initial_state: torch.Tensor | None,
    *,
    chunk_size: int = FLA_CHUNK_SIZE,
    output_final_state: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The chunked gated delta rule by fla; contract of ``recomputing_chunk_scan``.

    Args:
        q: [T, H, Dk] already scaled, or None (final states only; k stands in for q and the output is dropped);
            k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]; prepared, one float dtype, heads expanded.
        bounds: ``cu_seqlens`` as a list (empty sequences allowed: their final state is their initial state).
        initial_state: [n, H, Dk, Dv] or None (zeros). chunk_size: must be 64 (fla's).
    Returns:
        ``(o [T, H, Dv] or None, final_state [n, H, Dk, Dv] or None)``, float32 states; differentiable.
    """
    require_fla(k.device, "the fla GatedDeltaNet scan")
    if chunk_size != FLA_CHUNK_SIZE:
        raise ValueError(f"chunk_size={chunk_size}: the fla scan works in chunks of {FLA_CHUNK_SIZE}")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    n = len(bounds) - 1
    H, Dk, Dv = k.shape[1], k.shape[2], v.shape[2]
    keep = [i for i in range(n) if bounds[i + 1] > bounds[i]]  # fla is not asked about empty sequences
    if not keep:
        o = None if q is None else v.new_zeros(v.shape)
        start = initial_state if initial_state is not None else v.new_zeros(n, H, Dk, Dv, dtype=torch.float32)
        return o, start if output_final_state else None
    cu = torch.tensor([bounds[0], *[bounds[i + 1] for i in keep]], dtype=torch.int64, device=k.device)
    h0 = None if initial_state is None else initial_state[keep].float().contiguous()
    qq = k if q is None else q
    o, final = fla_rule(
        *(x.contiguous().unsqueeze(0) for x in (qq, k, v, g, beta)),
        scale=1.0,
        initial_state=h0,
        output_final_state=output_final_state,
        cu_seqlens=cu,
    )
    o = None if q is None else o[0]
    if not output_final_state:
        return o, None
    if len(keep) == n:
        return o, final
    full = initial_state.float().clone() if initial_state is not None else final.new_zeros(n, H, Dk, Dv)
    full = full.index_copy(0, torch.tensor(keep, device=final.device), final)
    return o, full


def fla_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv of a packed row by fla (no CP context); contract of ``causal_conv1d``.

    Args: x [T, channels]; weight [channels, K]; cu_seqlens int64 [n+1]; bias [channels] or None; activation
    ``"silu"`` or None. Returns [T, channels] in ``x.dtype``, differentiable in x, weight and bias.
    """
    require_fla(x.device, "the fla causal conv1d")
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    if x.shape[0] == 0:
        return x[:0] * weight[:, 0].to(x.dtype)
    y, _ = fla_conv(
        x.unsqueeze(0),
        weight=weight,
        bias=bias,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens.to(device=x.device, dtype=torch.int64),
    )
    return y[0].to(x.dtype)
