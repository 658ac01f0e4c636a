"""The GatedDeltaNet CP modes by name; both share one signature (see cp_headwise / cp_chunkwise)."""

from __future__ import annotations

from collections.abc import Callable

from ringtune.ops.gated_delta.cp_chunkwise import chunkwise_gated_delta
from ringtune.ops.gated_delta.cp_headwise import headwise_gated_delta

GDN_CP: dict[str, Callable] = {"headwise": headwise_gated_delta, "chunkwise": chunkwise_gated_delta}


def gdn_cp_fn(mode: str) -> Callable:
    """The GatedDeltaNet CP mode called ``mode`` ("headwise", the default elsewhere, or "chunkwise")."""
    if mode not in GDN_CP:
        raise ValueError(f"unknown GatedDeltaNet CP mode {mode!r}; choose one of {sorted(GDN_CP)}")
    return GDN_CP[mode]
