"""ringtune.sample.stopping: stop ids, stop strings (split over tokens, completed by a byte), EOS rules."""

from __future__ import annotations

import pytest

from ringtune.errors import UserInputError
from ringtune.sample.params import SamplingParams
from ringtune.sample.stopping import stop_condition, stop_reason
from tests.sample_fixtures import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

BYTES = {i: bytes([i]) for i in range(256)}


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: token i is byte i; incomplete UTF-8 decodes to U+FFFD, as HF's decode does."""
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def first_stop(cond, ids):
    """Index of the token at which ``cond`` stops, feeding ``ids`` one by one, or None."""
    for n in range(1, len(ids) + 1):
        if cond.check(ids[:n]):
            return n - 1
    return None


def test_none_stops_at_eos_only():
    cond = stop_condition(SamplingParams(), eos_token_ids=[2], vocab_size=256)
    assert first_stop(cond, [5, 6, 2, 7]) == 2
    assert first_stop(cond, [5, 6, 7]) is None


def test_empty_list_never_stops_not_even_eos():
    cond = stop_condition(SamplingParams(stop=[]), eos_token_ids=[2], vocab_size=256)
    assert first_stop(cond, [2, 2, 2]) is None


def test_token_ids_and_eos():
    cond = stop_condition(SamplingParams(stop=[9, 11]), eos_token_ids=[2], vocab_size=256)
    assert first_stop(cond, [5, 11, 9]) == 1
    assert first_stop(cond, [5, 2, 9]) == 1  # EOS still stops with a non-empty list
    assert first_stop(cond, [5, 6]) is None


def test_string_split_over_tokens_stops_at_completing_token():
    cond = stop_condition(SamplingParams(stop=["\n\nUser:"]), eos_token_ids=[], vocab_size=256, decode=byte_decode)
    ids = list(b"Hi there.\n\nUser: x")
    assert first_stop(cond, ids) == len(b"Hi there.\n\nUser:") - 1
    assert first_stop(cond, list(b"Hi\n\nUse")) is None


def test_string_completed_by_a_continuation_byte():
    """'é' is two bytes; the first alone decodes to U+FFFD, so only the second token completes the string."""
    cond = stop_condition(SamplingParams(stop=["é"]), eos_token_ids=[], vocab_size=256, decode=byte_decode)
    ids = list(b"caf") + list("é".encode()) + [33]
    assert first_stop(cond, ids) == 4


def test_prompt_text_is_not_searched():
    cond = stop_condition(SamplingParams(stop=["ab"]), eos_token_ids=[], vocab_size=256, decode=byte_decode)
    assert first_stop(cond, list(b"b")) is None  # "a" ended the prompt: the generated text is only "b"


def test_errors_name_the_field():
    with pytest.raises(UserInputError, match=r"stop\[1\]=300.*vocab_size=256"):
        stop_condition(SamplingParams(stop=[3, 300]), eos_token_ids=[], vocab_size=256)
    with pytest.raises(UserInputError, match="tokenizer"):
        stop_condition(SamplingParams(stop=["x"]), eos_token_ids=[], vocab_size=256)


def test_reasons():
    assert (stop_reason(True), stop_reason(False)) == ("stop", "length")
