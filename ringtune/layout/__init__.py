"""Pure index math of the zigzag THD layout (no torch.distributed)."""

from ringtune.layout.budget import rank_token_budget
from ringtune.layout.contiguous import (
    ContiguousPart,
    RelayoutPlan,
    contiguous_part,
    global_segment_bounds,
    rank_major_to_global,
    relayout_plan,
)
from ringtune.layout.targets import ScoredTargets, scored_targets
from ringtune.layout.zigzag import (
    PAD_INDEX,
    ZigzagPlan,
    chunk_len,
    zigzag_chunk_ranges,
    zigzag_place,
    zigzag_plan,
    zigzag_slice,
    zigzag_unslice,
)

__all__ = [
    "PAD_INDEX",
    "ContiguousPart",
    "RelayoutPlan",
    "ScoredTargets",
    "ZigzagPlan",
    "chunk_len",
    "contiguous_part",
    "global_segment_bounds",
    "rank_major_to_global",
    "rank_token_budget",
    "relayout_plan",
    "scored_targets",
    "zigzag_chunk_ranges",
    "zigzag_place",
    "zigzag_plan",
    "zigzag_slice",
    "zigzag_unslice",
]
