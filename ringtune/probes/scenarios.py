"""The catalogue of packed-row scenarios that ``ringtune attention-parity`` runs and every CP test draws from.

Each scenario is a tuple of sequence lengths for one packed row, chosen for a hard case of the
zigzag layout: rows of 1-17 tokens (some rank holds no real token of a sequence), lengths not
divisible by 2C, sequences longer than one chunk, and a pad-only row (no sequence at all).
"""

from __future__ import annotations

SCENARIOS: dict[str, tuple[int, ...]] = {
    # Short sequences: at C=4 a 1-token sequence leaves 7 of its 8 chunks (and 3 ranks) pure padding.
    "tiny_mix": (1, 2, 3, 5, 8, 13, 17, 4, 1, 16),
    # Lengths not divisible by 2C for any C in 1..8, and one sequence per residue class mod 8.
    "not_divisible": (7, 9, 29, 31, 6, 10, 12, 3),
    # One long sequence (many chunks' worth of tokens) among short ones.
    "long_mixed": (5, 333, 1, 17, 40),
    # A lone long datum.
    "long_alone": (257,),
    # A lone single token.
    "single_token": (1,),
    # No sequence: a pad-only row (every rank holds only the stream pad).
    "pad_only": (),
}
