"""When a sampled sequence ends: stop token ids, stop strings, or its length.

A sequence stops right after the token that

- is one of the stop token ids (EOS included unless ``stop == []``), or
- completes a stop string: the decoded text of the generated tokens (the prompt is not searched) contains it
  for the first time;

and that token is its last, returned exactly once; the stop reason is ``"stop"``. Otherwise it ends after
``max_tokens`` tokens with ``"length"`` (a token that both stops and reaches the length gives ``"stop"``).
Stop strings are checked on the whole generated text at every step, so a string split over tokens, or
completed by a byte that finishes a multi-byte character, is found at the token that completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ringtune.errors import UserInputError
from ringtune.sample.params import SamplingParams

STOP = "stop"
LENGTH = "length"

Decode = Callable[[list[int]], str]
"""Token ids -> text (e.g. a tokenizer's ``decode``); needed only for stop strings."""


class StopCondition:
    """The stop rule of one request; :meth:`check` is called for each sequence after each new token."""

    def __init__(self, token_ids: frozenset[int], strings: tuple[str, ...], decode: Decode | None) -> None:
        if strings and decode is None:
            raise UserInputError(f"stop strings {list(strings)!r} need a tokenizer to decode the generated text")
        self.token_ids = token_ids
        self.strings = strings
        self._decode = decode

    def check(self, generated: Sequence[int]) -> bool:
        """True if the sequence stops at its newest token ``generated[-1]``."""
        if not generated:
            return False
        if generated[-1] in self.token_ids:
            return True
        if self.strings:
            assert self._decode is not None
            text = self._decode(list(generated))
            return any(s in text for s in self.strings)
        return False


def stop_condition(
    params: SamplingParams, *, eos_token_ids: Sequence[int], vocab_size: int, decode: Decode | None = None
) -> StopCondition:
    """The :class:`StopCondition` of ``params.stop`` (see :mod:`ringtune.sample.params`) for a model.

    Raises UserInputError for a stop token id outside ``[0, vocab_size)`` or stop strings without ``decode``.
    """
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab_size:
            raise UserInputError(f"stop[{i}]={t}: a stop token id must be < vocab_size={vocab_size}")
    if params.stop is None:
        return StopCondition(frozenset(eos_token_ids), (), None)
    if len(params.stop) == 0:
        return StopCondition(frozenset(), (), None)
    ids = frozenset(params.stop_token_ids) | frozenset(eos_token_ids)
    return StopCondition(ids, params.stop_strings, decode)


def stop_reason(stopped: bool) -> str:
    """``"stop"`` for a sequence ended by a stop token or string, ``"length"`` for one that ran to max_tokens."""
    return STOP if stopped else LENGTH
