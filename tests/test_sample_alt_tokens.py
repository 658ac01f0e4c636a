"""Prompt alt tokens (``ringtune.sample.alt_tokens``, Tinker's ``prompt_alt_tokens_k``).

The draws are checked against a plain-Python inverse CDF of the tempered softmax of each row (float64), their
log-probs against the untempered ``log_softmax`` of the training forward's logits (float64, 1e-12), temperature 0
against the argmax, tiles against one tile (the same ids), the empirical distribution of 5000 draws against
:func:`token_probs` (each frequency within 0.03: four standard deviations of a frequency over 5000 draws), and
through :func:`generate`: the seed decides the draws whatever else is packed in the prefill.
"""

from __future__ import annotations

import math

import pytest
import torch

import ringtune.sample.alt_tokens as alt_tokens
from ringtune.errors import UserInputError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.shard import shard_of
from ringtune.sample import SamplingParams, generate
from ringtune.sample.alt_tokens import MAX_PROMPT_ALT_TOKENS_K, alt_uniforms, draw_alt_tokens
from ringtune.sample.choose import token_probs
from tests.sample_fixtures import random_prompts, sharp_checkpoint

VOCAB = 96


def _reference_draw(logits: list[float], temperature: float, u: float) -> int:
    """The token whose cumulative tempered probability (vocabulary order) first exceeds ``u · total``."""
    top = max(logits)
    weights = [math.exp((x - top) / temperature) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    target = u * math.fsum(probs)
    cum = 0.0
    for token, p in enumerate(probs):
        cum += p
        if cum > target:
            return token
    return len(logits) - 1


def _case(dtype: torch.dtype = torch.float64, rows: int = 13, vocab: int = 37):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(rows, 8, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, 8, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    return hidden, weight


def test_draws_are_the_inverse_cdf_and_logprobs_untempered():
    hidden, weight = _case()
    uniforms = alt_uniforms(5, hidden.shape[0], 6)
    ids, lps = draw_alt_tokens(hidden, weight, uniforms, 0.8)
    assert ids.shape == (13, 6) and ids.dtype == torch.int64 and lps.dtype == torch.float64
    logits = hidden @ weight.T
    for i in range(13):
        for j in range(6):
            assert ids[i, j].item() == _reference_draw(logits[i].tolist(), 0.8, uniforms[i, j].item())
    want = torch.log_softmax(logits, dim=-1).gather(1, ids)
    assert (lps - want).abs().max().item() < 1e-12
    assert ids.unique().numel() > 10  # really random draws, not one token


def test_temperature_zero_is_the_argmax_and_tiles_change_nothing(monkeypatch):
    hidden, weight = _case()
    uniforms = alt_uniforms(1, 13, 3)
    ids, _ = draw_alt_tokens(hidden, weight, uniforms, 0.0)
    assert torch.equal(ids, (hidden @ weight.T).argmax(-1, keepdim=True).expand(-1, 3))
    whole = draw_alt_tokens(hidden, weight, uniforms, 1.3)
    monkeypatch.setattr(alt_tokens, "ALT_TILE_BYTES", 8 * 37 * 2)  # two rows per tile
    tiled = draw_alt_tokens(hidden, weight, uniforms, 1.3)
    assert torch.equal(whole[0], tiled[0])
    assert (whole[1] - tiled[1]).abs().max().item() < 1e-12  # a matmul's blocking depends on its rows
    with pytest.raises(ValueError, match="rows"):
        draw_alt_tokens(hidden[:3], weight, uniforms, 1.0)


def test_draws_follow_the_tempered_distribution_float32():
    hidden, weight = _case(torch.float32, rows=1, vocab=8)
    many = hidden.expand(50, -1)
    ids, lps = draw_alt_tokens(many, weight, alt_uniforms(7, 50, 100), 0.7)
    assert lps.dtype == torch.float32
    freq = torch.bincount(ids.reshape(-1), minlength=8).double() / ids.numel()
    want = token_probs(hidden @ weight.T, SamplingParams(temperature=0.7))[0]
    assert (freq - want).abs().max().item() < 0.03, (freq, want)


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    path = tmp_path_factory.mktemp("alt")
    sharp_checkpoint("qwen3_5", path)
    return load_hf(path, dtype=torch.float64).eval()


def test_generate_returns_draws_of_the_prompt_distribution(model64):
    prompts = random_prompts((9, 1, 70), VOCAB, seed=2)
    params = SamplingParams(max_tokens=2, temperature=0.9, seed=31, stop=[])
    results = generate(model64, prompts, params, prompt_alt_tokens_k=5, prompt_logprobs=True)
    for prompt, r in zip(prompts, results, strict=True):
        ids, lps = r.prompt_alt_tokens
        assert ids.shape == lps.shape == (len(prompt) - 1, 5)
        if len(prompt) == 1:
            continue
        shard = shard_of([len(prompt)])
        with torch.no_grad():
            logits = model64.logits(zigzag_slice(torch.tensor(prompt), shard.plan), shard)[: len(prompt) - 1]
        want = torch.log_softmax(logits, dim=-1).gather(1, ids)
        assert (lps - want).abs().max().item() < 1e-12
        # The seed decides the draws: the prompt alone gives the same ones as packed with the others.
        alone = generate(model64, [prompt], params, prompt_alt_tokens_k=5)[0].prompt_alt_tokens
        assert torch.equal(alone[0], ids)
    other = generate(model64, prompts[2:], SamplingParams(max_tokens=2, temperature=0.9, seed=32, stop=[]),
                     prompt_alt_tokens_k=5)  # fmt: skip
    assert not torch.equal(other[0].prompt_alt_tokens[0], results[2].prompt_alt_tokens[0])
    plain = generate(model64, prompts[:1], params)
    assert plain[0].prompt_alt_tokens is None
    assert [s.tokens for s in plain[0].sequences] == [s.tokens for s in results[0].sequences]  # decode unchanged


@pytest.mark.parametrize("k", [-1, MAX_PROMPT_ALT_TOKENS_K + 1, 2.0, True])
def test_bad_k_is_a_user_error(model64, k):
    with pytest.raises(UserInputError, match=rf"prompt_alt_tokens_k={k!r} must be an int in \[0, 100\]"):
        generate(model64, [[1, 2, 3]], SamplingParams(max_tokens=1), prompt_alt_tokens_k=k)
