"""The registry of context-parallel mode names: every caller (configs, the CLI, the engine, tests) reads these.

- attention (full-attention layers): ``ring`` (zigzag ring of K/V blocks), ``allgather`` (all-gather K/V),
  ``alltoall`` (Ulysses: all-to-all to head shards; needs heads divisible by CP);
- gated_delta (GatedDeltaNet layers): ``headwise`` (all-to-all to head shards; needs linear heads divisible
  by CP), ``chunkwise`` (contiguous parts with recurrent-state hand-off; any head count).

The functions behind the names are in :data:`ringtune.ops.attention.CP_ATTENTION` and
:data:`ringtune.ops.gated_delta.cp.GDN_CP`, whose keys are checked against these tuples at import.
"""

from __future__ import annotations

from ringtune.errors import ParallelConfigError

ATTENTION_MODES: tuple[str, ...] = ("ring", "allgather", "alltoall")
"""CP attention modes; the first is the default."""

GATED_DELTA_MODES: tuple[str, ...] = ("headwise", "chunkwise")
"""CP GatedDeltaNet modes; the first is the default."""

DEFAULT_ATTENTION = ATTENTION_MODES[0]
DEFAULT_GATED_DELTA = GATED_DELTA_MODES[0]


def check_attention_mode(mode: object, field: str = "attention") -> str:
    """``mode`` if it is an attention mode name, else ParallelConfigError naming ``field`` and the choices."""
    if not isinstance(mode, str) or mode not in ATTENTION_MODES:
        raise ParallelConfigError(f"{field}={mode!r}: choose one of {', '.join(ATTENTION_MODES)}")
    return mode


def check_gated_delta_mode(mode: object, field: str = "gated_delta") -> str:
    """``mode`` if it is a GatedDeltaNet CP mode name, else ParallelConfigError naming ``field`` and the choices."""
    if not isinstance(mode, str) or mode not in GATED_DELTA_MODES:
        raise ParallelConfigError(f"{field}={mode!r}: choose one of {', '.join(GATED_DELTA_MODES)}")
    return mode
