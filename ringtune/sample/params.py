"""Sampling parameters (Tinker's ``SamplingParams``), validated where they enter.

Every refusal is a :class:`ringtune.errors.UserInputError` naming the field, the value and the limit.
The dataclass is frozen and holds only ints, floats, strings and tuples, so it pickles (a gateway sends
it to the worker ranks as it is).

``stop``:

- ``None``: stop at the model's end-of-sequence token(s);
- ``()`` / ``[]``: never stop (not even at EOS) until ``max_tokens``;
- a string or strings: stop right after the token that completes one of them in the decoded text, or at EOS;
- token ids: stop after sampling one of them, or at EOS.

(EOS stays a stop with a non-empty list, as the SDK documents ``None`` as "implicit EOS stopping" and only
``[]`` as disabling it.) The stopping token is the last one returned, exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ringtune.errors import UserInputError

DEFAULT_MAX_TOKENS = 1024
"""``max_tokens`` when a request leaves it out (the SDK allows that)."""

MAX_TOKENS_LIMIT = 131072
"""Most tokens one sequence may generate."""

MAX_STOP_ENTRIES = 64
"""Most stop strings or token ids per request."""

MAX_STOP_CHARS = 1024
"""Longest stop string."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _normalise_stop(stop: Any) -> tuple[str, ...] | tuple[int, ...] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple):
        raise UserInputError(f"stop must be None, a string, a list of strings or a list of token ids; got {stop!r}")
    if len(stop) > MAX_STOP_ENTRIES:
        raise UserInputError(f"stop has {len(stop)} entries; the limit is {MAX_STOP_ENTRIES}")
    if all(isinstance(s, str) for s in stop):
        for i, s in enumerate(stop):
            if not s or len(s) > MAX_STOP_CHARS:
                shown = repr(s) if len(s) <= 40 else f"{s[:40]!r}... ({len(s)} characters)"
                raise UserInputError(f"stop[{i}]={shown}: a stop string must have 1 to {MAX_STOP_CHARS} characters")
        return tuple(stop)
    if all(_is_int(s) for s in stop):
        for i, s in enumerate(stop):
            if s < 0:
                raise UserInputError(f"stop[{i}]={s}: a stop token id must be >= 0")
        return tuple(stop)
    for i, s in enumerate(stop):
        if not (isinstance(s, str) or _is_int(s)):
            raise UserInputError(f"stop[{i}]={s!r}: entries must be strings or token ids (int)")
    raise UserInputError(f"stop={list(stop)!r} mixes strings and token ids; give one kind")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one sequence (the same for every sample of a request).

    Attributes:
        max_tokens: most tokens to generate, in [1, MAX_TOKENS_LIMIT]; None becomes DEFAULT_MAX_TOKENS.
        temperature: 0 is greedy (argmax); otherwise logits are divided by it. Finite, >= 0.
        top_k: -1 (off) or >= 1: sample among the k most likely tokens (after temperature).
        top_p: in (0, 1]: sample among the smallest set of most likely tokens whose probability (after
            temperature and top_k) sums to at least top_p; 1 is off.
        seed: None (fresh randomness) or an int: the same seed, prompt and parameters give the same tokens.
        stop: see the module docstring; normalised to a tuple (or None).
    """

    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise UserInputError(f"max_tokens={max_tokens!r} must be an int in [1, {MAX_TOKENS_LIMIT}]")
        object.__setattr__(self, "max_tokens", max_tokens)
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise UserInputError(f"temperature={t!r} must be a finite number >= 0 (0 is greedy)")
        object.__setattr__(self, "temperature", float(t))
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise UserInputError(f"top_k={self.top_k!r} must be -1 (off) or an int >= 1")
        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise UserInputError(f"top_p={p!r} must be a number in (0, 1] (1 is off)")
        object.__setattr__(self, "top_p", float(p))
        if self.seed is not None and not _is_int(self.seed):
            raise UserInputError(f"seed={self.seed!r} must be an int or None")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop or () if isinstance(s, str))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(s for s in self.stop or () if not isinstance(s, str))
