"""ringtune.sample.engines.vllm_api: Tinker requests -> vLLM completion bodies and vLLM answers -> PromptSamples.

Pure translation: no engine needed (the answers below have the shape vLLM 0.32's ``/v1/completions`` returns with
``return_tokens_as_token_ids`` and ``return_token_ids``; tests/test_vllm_sampling.py checks them against a real
engine).
"""

from __future__ import annotations

import pytest
import torch

from ringtune.sample.engines.vllm_api import (
    EngineAnswerError,
    completion_body,
    merged_samples,
    prompt_samples,
    split_request,
)
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest
from ringtune.sample.sampler import PromptSamples, SampledSequence


def _request(**kwargs) -> SampleRequest:
    params = kwargs.pop("params", SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, seed=7))
    return SampleRequest(prompt=[3, 4, 5], params=params, **kwargs)


def test_completion_body_carries_every_sampling_parameter():
    body = completion_body(_request(num_samples=2, topk_sample_logprobs=4), "base")
    assert body["model"] == "base" and body["prompt"] == [3, 4, 5] and body["n"] == 2
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["top_p"], body["seed"]) == (3, 0.7, 5, 0.9, 7)
    assert body["logprobs"] == 4 and body["return_tokens_as_token_ids"] and body["return_token_ids"]
    assert "stop" not in body and "stop_token_ids" not in body and "ignore_eos" not in body
    assert "prompt_logprobs" not in body


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, {}),
        ([], {"ignore_eos": True}),
        (["\n", "ab"], {"stop": ["\n", "ab"]}),
        ([9, 11], {"stop_token_ids": [9, 11]}),
    ],
)
def test_stop_rules(stop, expected):
    body = completion_body(_request(params=SamplingParams(max_tokens=4, stop=stop)), "m")
    got = {k: body[k] for k in ("ignore_eos", "stop", "stop_token_ids") if k in body}
    assert got == expected
    assert body["include_stop_str_in_output"] is True  # the completing token is returned, as the built-in does


def test_top_k_off_seed_folded_and_greedy():
    body = completion_body(_request(params=SamplingParams(max_tokens=2, temperature=0.0, seed=-1)), "m")
    assert body["top_k"] == 0 and body["temperature"] == 0.0 and body["seed"] == 2**63 - 1
    assert "seed" not in completion_body(_request(params=SamplingParams(max_tokens=2)), "m")


def test_split_request_moves_what_the_engine_cannot_answer():
    targets = torch.tensor([[1, 2], [3, -1]])
    full = _request(prompt_logprobs=True, topk_prompt_logprobs=3, target_tokens=targets, prompt_alt_tokens_k=2)
    engine, forward = split_request(full, engine_prompt_logprobs=True)
    assert engine.prompt_logprobs and engine.topk_prompt_logprobs == 3
    assert engine.target_tokens is None and engine.prompt_alt_tokens_k == 0
    assert forward is not None and forward.target_tokens is targets and forward.prompt_alt_tokens_k == 2
    assert not forward.prompt_logprobs and forward.topk_prompt_logprobs == 0
    assert forward.num_samples == 1 and forward.params.max_tokens == 1

    engine, forward = split_request(full, engine_prompt_logprobs=False)  # e.g. vLLM with --enable-lora
    assert not engine.prompt_logprobs and engine.topk_prompt_logprobs == 0
    assert forward is not None and forward.prompt_logprobs and forward.topk_prompt_logprobs == 3

    plain = _request(num_samples=3)
    assert split_request(plain, engine_prompt_logprobs=False) == (plain, None)
    with pytest.raises(ValueError, match="split_request"):
        completion_body(full, "m")


def _choice(index: int, tokens: list[int], lps: list[float], reason: str, top=None) -> dict:
    logprobs = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": lps, "top_logprobs": top}
    return {"index": index, "token_ids": tokens, "logprobs": logprobs, "finish_reason": reason}


def test_prompt_samples_reads_tokens_logprobs_topk_and_stop_reasons():
    top = [{"token_id:8": -0.5, "token_id:2": -0.1, "token_id:6": -3.0}, {"token_id:9": -0.2, "token_id:1": -2.0}]
    answer = {
        "choices": [
            _choice(1, [9], [-0.3], "length", [{"token_id:9": -0.3, "token_id:4": -1.0}]),
            _choice(0, [8, 9], [-0.5, -0.2], "stop", top),
        ]
    }
    result = prompt_samples(answer, _request(num_samples=2, topk_sample_logprobs=2))
    first, second = result.sequences
    assert (first.tokens, first.logprobs, first.stop_reason) == ([8, 9], [-0.5, -0.2], "stop")
    assert first.topk_logprobs == [[(2, -0.1), (8, -0.5)], [(9, -0.2), (1, -2.0)]]  # the sampled 6 is dropped: k=2
    assert (second.tokens, second.stop_reason) == ([9], "length")
    assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None


def test_prompt_logprobs_own_token_and_topk():
    rows = [None, {"4": {"logprob": -1.5}, "7": {"logprob": -0.2}}, {"5": {"logprob": -0.1}, "2": {"logprob": -3.0}}]
    answer = {"choices": [_choice(0, [1], [-0.4], "length") | {"prompt_logprobs": rows}]}
    result = prompt_samples(answer, _request(prompt_logprobs=True, topk_prompt_logprobs=1))
    assert result.prompt_logprobs == [None, -1.5, -0.1]
    assert result.topk_prompt_logprobs == [None, [(7, -0.2)], [(5, -0.1)]]


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": []},  # too few
        {"choices": [_choice(0, [1, 2], [-0.1], "stop")]},  # log-probs shorter than tokens
        {"choices": [_choice(0, [1], [-0.1], "abort")]},  # not a stop reason
        {"choices": [_choice(0, [1], [-0.1], "stop") | {"token_ids": [2]}]},  # names disagree with ids
    ],
)
def test_malformed_answers_are_engine_errors(answer):
    with pytest.raises(EngineAnswerError):
        prompt_samples(answer, _request())


def test_merged_samples_takes_prompt_answers_from_the_forward():
    seq = SampledSequence(tokens=[1], logprobs=[-0.1], stop_reason="length")
    engine = PromptSamples(sequences=[seq], prompt_logprobs=[None, -1.0])
    forward = PromptSamples(
        sequences=[SampledSequence(tokens=[5], logprobs=[-9.0], stop_reason="length")],
        topk_prompt_logprobs=[None, [(3, -0.5)]],
        target_prompt_logprobs=torch.zeros(1, 2),
    )
    merged = merged_samples(engine, forward)
    assert merged.sequences == [seq] and merged.prompt_logprobs == [None, -1.0]
    assert merged.topk_prompt_logprobs == [None, [(3, -0.5)]] and merged.target_prompt_logprobs is not None
    assert merged_samples(engine, None) is engine
