"""The registry of context-parallel mode names: every caller (configs, the CLI, the engine, tests) reads these.

- attention (full-attention layers): ``ring`` (zigzag ring of K/V blocks), ``allgather`` (all-gather K/V),
  ``alltoall`` (Ulysses: all-to-all to head shards; needs heads divisible by CP);
- gated_delta (GatedDeltaNet layers): ``headwise`` (all-to-all to head shards; needs linear heads divisible
  by CP), ``chunkwise`` (contiguous parts with recurrent-state hand-off; any head count), and on CUDA with fla
  installed ``fla_cp`` (the chunkwise layout with fla's own conv halo and state chain, ``fla.ops.cp``; any head
  count; never chosen by default, refused where it cannot run: :func:`fla_cp_unavailable_reason`).

The functions behind the names are in :data:`ringtune.ops.attention.CP_ATTENTION` and
:data:`ringtune.ops.gated_delta.cp.GDN_CP`, whose keys are checked against these tuples at import.
"""

from __future__ import annotations

import torch

from ringtune.errors import ParallelConfigError
from ringtune.ops.triton_device import installed, triton_interpreting

ATTENTION_MODES: tuple[str, ...] = ("ring", "allgather", "alltoall")
"""CP attention modes; the first is the default."""

GATED_DELTA_MODES: tuple[str, ...] = ("headwise", "chunkwise")
"""CP GatedDeltaNet modes every host runs (the CPU oracle included), in the order a default is chosen; the first is
the default."""

GATED_DELTA_CUDA_MODES: tuple[str, ...] = ("fla_cp",)
"""CP GatedDeltaNet modes by Triton kernels: CUDA with ``fla`` installed (CPU only under Triton's interpreter);
selected by name only (``--linear-cp-mode fla_cp``), never a default."""

ALL_GATED_DELTA_MODES: tuple[str, ...] = GATED_DELTA_MODES + GATED_DELTA_CUDA_MODES
"""Every CP GatedDeltaNet mode name (the CLI's choices)."""

DEFAULT_ATTENTION = ATTENTION_MODES[0]
DEFAULT_GATED_DELTA = GATED_DELTA_MODES[0]


def check_attention_mode(mode: object, field: str = "attention") -> str:
    """``mode`` if it is an attention mode name, else ParallelConfigError naming ``field`` and the choices."""
    if not isinstance(mode, str) or mode not in ATTENTION_MODES:
        raise ParallelConfigError(f"{field}={mode!r}: choose one of {', '.join(ATTENTION_MODES)}")
    return mode


def fla_cp_unavailable_reason() -> str | None:
    """Why ``fla_cp`` cannot run in this process (no CUDA outside Triton's interpreter, fla or triton missing), or
    None. Nothing is imported here."""
    if not (torch.cuda.is_available() or triton_interpreting()):
        return "it runs fla's Triton kernels on CUDA and this host has no CUDA device"
    if not installed("fla", "triton"):
        return "flash-linear-attention and triton are not installed (pip install 'ringtune[gpu]', docs/gpu.md)"
    return None


def check_gated_delta_mode(mode: object, field: str = "gated_delta") -> str:
    """``mode`` if it is a GatedDeltaNet CP mode name that can run here, else ParallelConfigError naming ``field``,
    the choices, or (``fla_cp`` without CUDA or fla) the reason and the portable mode to use instead."""
    if not isinstance(mode, str) or mode not in ALL_GATED_DELTA_MODES:
        raise ParallelConfigError(f"{field}={mode!r}: choose one of {', '.join(ALL_GATED_DELTA_MODES)}")
    if mode in GATED_DELTA_CUDA_MODES:
        reason = fla_cp_unavailable_reason()
        if reason is not None:
            raise ParallelConfigError(
                f"{field}={mode!r} (--linear-cp-mode {mode}) cannot run here: {reason}; use --linear-cp-mode chunkwise"
            )
    return mode
