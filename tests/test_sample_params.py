"""ringtune.sample.params: defaults, normalisation, and the catalogue of refused values (each names its field)."""

from __future__ import annotations

import math
import pickle

import pytest

from ringtune.errors import UserInputError
from ringtune.sample.params import DEFAULT_MAX_TOKENS, MAX_STOP_ENTRIES, MAX_TOKENS_LIMIT, SamplingParams
from tests.sample_fixtures import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop) == (DEFAULT_MAX_TOKENS, 1.0, -1, 1.0,
                                                                                None, None)  # fmt: skip
    assert SamplingParams(max_tokens=None).max_tokens == DEFAULT_MAX_TOKENS
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=[]).stop == ()
    assert SamplingParams(stop=[5, 7]).stop_token_ids == (5, 7)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")
    assert SamplingParams(temperature=0).greedy and isinstance(SamplingParams(temperature=1).temperature, float)
    p = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, top_p=0.9, seed=11, stop=["x"])
    assert pickle.loads(pickle.dumps(p)) == p


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": None}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": False}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, r"stop\[0\]"),
    ({"stop": ["a", 3]}, "mixes"),
    ({"stop": [3, -1]}, r"stop\[1\]"),
    ({"stop": [1.5]}, r"stop\[0\]"),
    ({"stop": [True]}, r"stop\[0\]"),
    ({"stop": ["x"] * (MAX_STOP_ENTRIES + 1)}, "entries"),
    ({"stop": ["x" * 5000]}, r"stop\[0\]"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD, ids=[f"{i}-{next(iter(k))}" for i, (k, _) in enumerate(BAD)])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(UserInputError, match=field) as err:
        SamplingParams(**kwargs)
    value = next(iter(kwargs.values()))
    if not isinstance(value, list):  # list entries are named by index (stop[i]=...)
        assert repr(value) in str(err.value) or str(value) in str(err.value), err.value
