"""The GatedDeltaNet CP modes by name; all share one signature (see cp_headwise / cp_chunkwise / cp_fla)."""

from __future__ import annotations

from collections.abc import Callable

from ringtune.ops.cp_modes import ALL_GATED_DELTA_MODES, check_gated_delta_mode
from ringtune.ops.gated_delta.cp_chunkwise import chunkwise_gated_delta
from ringtune.ops.gated_delta.cp_fla import fla_cp_gated_delta
from ringtune.ops.gated_delta.cp_headwise import headwise_gated_delta

GDN_CP: dict[str, Callable] = {
    "headwise": headwise_gated_delta,
    "chunkwise": chunkwise_gated_delta,
    "fla_cp": fla_cp_gated_delta,
}
assert tuple(GDN_CP) == ALL_GATED_DELTA_MODES, "ringtune.ops.cp_modes is the registry of mode names"


def gdn_cp_fn(mode: str) -> Callable:
    """The GatedDeltaNet CP mode called ``mode`` ("headwise", the default elsewhere, "chunkwise" or "fla_cp");
    ParallelConfigError for an unknown name or ``fla_cp`` where it cannot run."""
    return GDN_CP[check_gated_delta_mode(mode)]
