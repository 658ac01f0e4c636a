"""The input contract of the gated delta rule ops: shape checks and the shared preparation.

Layout (packed THD row, one or more sequences back to back):
- ``q``, ``k``: [T, Hk, Dk]; ``v``: [T, Hv, Dv] with ``Hv % Hk == 0`` (grouped value heads: value
  head ``h`` reads key/query head ``h // (Hv // Hk)``, as ``repeat_interleave`` in transformers);
- ``g`` (log decay, ≤ 0), ``beta`` (in (0, 1)): [T, Hv];
- ``cu_seqlens``: int64 [n+1], 0 first, T last, non-decreasing; the state resets at every boundary;
- ``initial_state``: [n, Hv, Dk, Dv], one state per sequence.
Every check raises ``ValueError`` naming the argument, the expected and the actual shape.
"""

from __future__ import annotations

import itertools
from typing import overload

import torch

from ringtune.ops.gated_delta.norm import l2norm


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops accumulate in: float64 for float64 inputs, float32 for anything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """Validate ``cu_seqlens`` (int64 [n+1], 0 first, ``total`` last, non-decreasing); return it as a list."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1:
        got = (cu_seqlens.dtype, tuple(cu_seqlens.shape)) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens)
        raise ValueError(f"cu_seqlens must be an int64 tensor of shape [n+1]; got {got}")
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={total}; got {bounds[:3]}...{bounds[-3:]}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {bounds}")
    return bounds


def _shape_error(name: str, expected: str, tensor: torch.Tensor) -> ValueError:
    return ValueError(f"{name} must have shape {expected}; got {tuple(tensor.shape)}")


def check_gated_delta_inputs(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> list[int]:
    """Check the layout described in the module docstring; return ``cu_seqlens`` as a list of ints.

    ``q`` may be None (ops that never read the state, e.g. the affine summary).
    """
    if k.dim() != 3:
        raise _shape_error("k", "[T, Hk, Dk]", k)
    T, Hk, Dk = k.shape
    if q is not None and q.shape != k.shape:
        raise _shape_error("q", f"[T, Hk, Dk] = {[T, Hk, Dk]} (as k)", q)
    if v.dim() != 3 or v.shape[0] != T or v.shape[1] % Hk:
        raise _shape_error("v", f"[T, Hv, Dv] with T={T} and Hv a multiple of Hk={Hk}", v)
    Hv, Dv = v.shape[1], v.shape[2]
    for name, gate in (("g", g), ("beta", beta)):
        if gate.shape != (T, Hv):
            raise _shape_error(name, f"[T, Hv] = {[T, Hv]}", gate)
        if not gate.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor; got {gate.dtype}")
    dtypes = {x.dtype for x in (q, k, v) if x is not None}
    if len(dtypes) != 1 or not k.is_floating_point():
        raise ValueError(f"q, k and v must share one floating dtype; got {sorted(map(str, dtypes))}")
    bounds = check_cu_seqlens(cu_seqlens, T)
    n = len(bounds) - 1
    if initial_state is not None and initial_state.shape != (n, Hv, Dk, Dv):
        raise _shape_error("initial_state", f"[n, Hv, Dk, Dv] = {[n, Hv, Dk, Dv]}", initial_state)
    return bounds


@overload
def prepare_gated_delta_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def prepare_gated_delta_inputs(
    q: None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


def prepare_gated_delta_inputs(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast to the compute dtype, expand key heads to value heads, L2-normalise q/k, scale q.

    Returns ``(q [T, Hv, Dk] · scale or None, k [T, Hv, Dk], v [T, Hv, Dv], g [T, Hv], beta [T, Hv])``,
    all in :func:`compute_dtype` of ``k.dtype``. ``scale`` defaults to ``Dk ** -0.5``. Differentiable.
    """
    acc = compute_dtype(k.dtype)
    group = v.shape[1] // k.shape[1]
    Dk = k.shape[-1]
    if scale is None:
        scale = Dk**-0.5

    def keys(x: torch.Tensor) -> torch.Tensor:
        x = x.to(acc)
        if use_qk_l2norm:
            x = l2norm(x)
        return x.repeat_interleave(group, dim=1) if group > 1 else x

    q_out = keys(q) * scale if q is not None else None
    return q_out, keys(k), v.to(acc), g.to(acc), beta.to(acc)
