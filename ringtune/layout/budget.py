"""Per-rank token budget of the zigzag layout (pure arithmetic)."""

from __future__ import annotations

from ringtune.errors import LayoutError
from ringtune.layout.zigzag import chunk_len, stream_pad_multiple


def rank_token_budget(context_len: int, cp_size: int, *, tp_size: int = 1, pad_multiplier: int = 128) -> int:
    """Tokens one CP rank holds for a row of one ``context_len``-token datum plus one.

    ``roundup(2·ceil((L+1)/(2C)), tp_size*pad_multiplier)``; for L = 131072: 66048 at TP4/CP2,
    33280 at TP4/CP4, 16512 at TP1/CP8.
    """
    if context_len < 1:
        raise LayoutError(f"context_len must be >= 1, got {context_len}")
    multiple = stream_pad_multiple(tp_size, pad_multiplier)
    local = 2 * chunk_len(context_len + 1, cp_size)
    return -(-local // multiple) * multiple
