"""Causal varlen attention over packed THD rows: a plain reference and three CP variants.

All variants share one signature, ``fn(q, k, v, plan, group, *, scale=None, kernel=None) ->
(out, lse)`` on this rank's zigzag shard, and are picked by name from :data:`CP_ATTENTION`.
"""

from collections.abc import Callable

from ringtune.ops.attention.allgather import allgather_attention
from ringtune.ops.attention.blocks import varlen_block_attention
from ringtune.ops.attention.reference import reference_varlen_attention
from ringtune.ops.attention.ring import ring_attention
from ringtune.ops.attention.ulysses import check_ulysses_heads, ulysses_attention
from ringtune.ops.cp_modes import ATTENTION_MODES, check_attention_mode

CP_ATTENTION: dict[str, Callable] = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "alltoall": ulysses_attention,
}
assert tuple(CP_ATTENTION) == ATTENTION_MODES, "ringtune.ops.cp_modes is the registry of mode names"


def cp_attention_fn(mode: str) -> Callable:
    """The CP attention variant called ``mode`` ("ring", "allgather" or "alltoall")."""
    return CP_ATTENTION[check_attention_mode(mode)]


__all__ = [
    "CP_ATTENTION",
    "allgather_attention",
    "check_ulysses_heads",
    "cp_attention_fn",
    "reference_varlen_attention",
    "ring_attention",
    "ulysses_attention",
    "varlen_block_attention",
]
