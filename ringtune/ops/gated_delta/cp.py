"""The GatedDeltaNet CP modes by name; both share one signature (see cp_headwise / cp_chunkwise)."""

from __future__ import annotations

from collections.abc import Callable

from ringtune.ops.cp_modes import GATED_DELTA_MODES, check_gated_delta_mode
from ringtune.ops.gated_delta.cp_chunkwise import chunkwise_gated_delta
from ringtune.ops.gated_delta.cp_headwise import headwise_gated_delta

GDN_CP: dict[str, Callable] = {"headwise": headwise_gated_delta, "chunkwise": chunkwise_gated_delta}
assert tuple(GDN_CP) == GATED_DELTA_MODES, "ringtune.ops.cp_modes is the registry of mode names"


def gdn_cp_fn(mode: str) -> Callable:
    """The GatedDeltaNet CP mode called ``mode`` ("headwise", the default elsewhere, or "chunkwise")."""
    return GDN_CP[check_gated_delta_mode(mode)]
