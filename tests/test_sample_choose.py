"""ringtune.sample.choose: the batched token choice against its plain-Python distribution oracle.

The distribution (:func:`token_probs`) must equal the oracle for temperature, top_k, top_p and their mix;
draws by inverse CDF must follow it (frequencies over 20,000 draws within 5 standard errors), top_k=1 and
temperature 0 are greedy, top_p keeps the smallest set with mass >= p, and temperature sharpens/flattens.
"""

from __future__ import annotations

import pytest
import torch

from ringtune.sample.choose import choose_tokens, reference_token_probs, token_probs
from ringtune.sample.params import SamplingParams
from tests.sample_fixtures import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

V = 50


def logits(rows=3, seed=0, dtype=torch.float32):
    return (torch.randn(rows, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2).to(dtype)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0, top_k=5),
    SamplingParams(top_p=0.7),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.5),
    SamplingParams(top_k=V + 10),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_distribution_equals_reference(params):
    x = logits(dtype=torch.float64)
    got = token_probs(x, params)
    for b in range(x.shape[0]):
        want = torch.zeros(V, dtype=torch.float64)
        for i, p in reference_token_probs(x[b].tolist(), params).items():
            want[i] = p
        assert (got[b] - want).abs().max() < 1e-12


def test_draws_follow_the_distribution():
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9)
    x = logits(rows=1, seed=3).expand(20000, V)
    u = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    counts = torch.bincount(choose_tokens(x, params, u), minlength=V).double() / 20000
    p = token_probs(x[:1], params)[0]
    assert (counts[p == 0] == 0).all()
    assert ((counts - p).abs() <= 5 * (p * (1 - p) / 20000).sqrt() + 1e-9).all()


def test_greedy_and_top_k_one():
    x = logits()
    greedy = choose_tokens(x, SamplingParams(temperature=0.0), None)
    assert torch.equal(greedy, x.argmax(-1))
    u = torch.rand(3, dtype=torch.float64)
    assert torch.equal(choose_tokens(x, SamplingParams(top_k=1, temperature=3.0), u), greedy)
    assert torch.equal(choose_tokens(x, SamplingParams(top_p=1e-6), u), greedy)


def test_top_p_keeps_smallest_set_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: set(token_probs(x, SamplingParams(top_p=p))[0].nonzero()[:, 0].tolist())  # noqa: E731
    assert kept(0.5) == {0}
    assert kept(0.51) == {0, 1}
    assert kept(0.8) == {0, 1}
    assert kept(0.81) == {0, 1, 2}
    assert kept(1.0) == {0, 1, 2, 3}


def test_temperature_scales():
    x = logits(rows=1, dtype=torch.float64)
    p1 = token_probs(x, SamplingParams(temperature=1.0))[0]
    p05 = token_probs(x, SamplingParams(temperature=0.5))[0]
    assert (p05 - torch.softmax(x[0] * 2, -1)).abs().max() < 1e-12  # T = 0.5 is softmax(2·logits)
    assert p05.max() > p1.max() and token_probs(x, SamplingParams(temperature=4.0))[0].max() < p1.max()


def test_uniform_zero_and_near_one_stay_in_the_support():
    params = SamplingParams(top_k=3)
    x = logits(rows=2)
    for u in (0.0, 1.0 - 1e-16):
        tok = choose_tokens(x, params, torch.full((2,), u, dtype=torch.float64))
        assert all(t in x[b].topk(3).indices.tolist() for b, t in enumerate(tok.tolist()))
