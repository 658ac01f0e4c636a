"""The fixed, seeded datum set of ``ringtune parity run`` (a pure function of the seed, the vocabulary, the
server's context length and the token source, so two servers of the same model get identical requests).

- ``short``: 17 rows of 1..17 tokens (a 1-token datum; at CP 2 and 4 some rank holds one scored position or
  none, and the last token of most rows lands on a rank other than 0);
- ``text``: rows of 1/8, 1/4, 1/2 and all of ``min(context, 8192)`` tokens cut from natural text;
- ``lone``: one 7-token datum sent alone (at DP > 1 every other DP rank runs a pad-only microbatch);
- ``long``: two lone datums of ``context · 4000/8192`` and ``context · 8000/8192`` tokens (the 4000- and
  8000-token datums of an 8K server), whose loss is on their second half only, so the gradient of the first half
  crosses every chunkwise-GDN split backwards;
- ``tail``: one lone datum of ``context · 3/4 - 5`` tokens whose loss is on its last 1/16 only: sent alone, its
  row's scored tokens all sit in the last zigzag chunk (rank 0), so every other CP rank holds no scored token
  while its tokens still shape theirs (its backward matters).

Targets are the next token of the text (cross-entropy on real text), weights are seeded in [0.5, 1.5].
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ringtune.parity.text import PASSAGE

SHORT_LENGTHS = tuple(range(1, 18))
TEXT_FRACTIONS = (8, 4, 2, 1)
TEXT_CAP = 8192
LONE_LENGTH = 7
LONG_FRACTIONS = (4000 / 8192, 8000 / 8192)
TAIL_FRACTION, TAIL_SCORED = 3 / 4, 1 / 16


@dataclass(frozen=True)
class ParityDatum:
    """One datum: ``tokens`` (model input), ``targets`` and ``weights`` (one per token); ``kind`` is
    ``short`` / ``text`` / ``lone`` / ``long``."""

    name: str
    kind: str
    tokens: tuple[int, ...]
    targets: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class DatumSet:
    """The requests' datums: ``main`` (short + text rows), ``lone``, the two ``long`` ones and ``tail``."""

    main: tuple[ParityDatum, ...]
    lone: ParityDatum
    long: tuple[ParityDatum, ...]
    tail: ParityDatum

    def digest(self) -> str:
        """SHA-256 of every token, target and weight (compare refuses dumps of different data)."""
        h = hashlib.sha256()
        for d in (*self.main, self.lone, *self.long, self.tail):
            h.update(repr((d.name, d.tokens, d.targets, d.weights)).encode())
        return h.hexdigest()


def text_token_stream(vocab_size: int, encode: Callable[[str], Sequence[int]] | None) -> list[int]:
    """Token ids of :data:`PASSAGE`: ``encode(PASSAGE)`` when given, else its UTF-8 bytes modulo ``vocab_size``
    (for tiny test vocabularies whose tokenizer has no English words)."""
    if encode is not None:
        ids = [int(t) for t in encode(PASSAGE)]
    else:
        ids = [b % vocab_size for b in PASSAGE.encode()]
    if not ids or max(ids) >= vocab_size or min(ids) < 0:
        raise ValueError(f"text tokens must lie in [0, {vocab_size}); got {len(ids)} ids")
    return ids


def build_datum_set(
    *, seed: int, vocab_size: int, context_length: int, stream: Sequence[int], long_context: int | None = None
) -> DatumSet:
    """The datum set for a server of ``context_length`` tokens (``long_context`` caps the long rows lower, for
    small machines). ``stream`` is :func:`text_token_stream`'s output; rows longer than it repeat it."""
    ctx = min(context_length, long_context or context_length)
    if ctx < 64:
        raise ValueError(f"context_length={ctx}: the parity set needs at least 64 tokens per datum")
    rng = np.random.default_rng(seed)
    base = list(stream)

    def cut(n: int) -> tuple[list[int], list[int]]:
        start = int(rng.integers(0, len(base)))
        reps = (start + n + 1) // len(base) + 1
        window = (base * (reps + 1))[start : start + n + 1]
        return window[:-1], window[1:]

    def datum(name: str, kind: str, n: int, scored_from: float = 0.0) -> ParityDatum:
        tokens, targets = cut(n)
        weights = rng.uniform(0.5, 1.5, n)
        weights[: int(n * scored_from)] = 0.0
        return ParityDatum(name, kind, tuple(tokens), tuple(targets), tuple(float(w) for w in weights))

    short = [datum(f"short{n}", "short", n) for n in SHORT_LENGTHS]
    text_ctx = min(ctx, TEXT_CAP)
    # Odd offsets keep the lengths off multiples of 2C, so tail pads appear at every CP size.
    text = [datum(f"text{k}", "text", max(text_ctx // f - 3, 18)) for k, f in enumerate(TEXT_FRACTIONS)]
    lone = datum("lone", "lone", LONE_LENGTH)
    long = [datum(f"long{k}", "long", max(int(ctx * f), 32), 0.5) for k, f in enumerate(LONG_FRACTIONS)]
    tail = datum("tail", "long", int(ctx * TAIL_FRACTION) - 5, 1 - TAIL_SCORED)
    return DatumSet(main=(*short, *text), lone=lone, long=tuple(long), tail=tail)
