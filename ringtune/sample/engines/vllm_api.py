"""Tinker sampling requests <-> vLLM's OpenAI ``/v1/completions``: pure translation, no HTTP.

One :class:`~ringtune.sample.pool.SampleRequest` is one completion call (``n`` = ``num_samples``; the prompt as
token ids). What vLLM answers and how it maps back:

======================================  ===============================================================
Tinker (``SampleRequest``)              vLLM ``/v1/completions``
======================================  ===============================================================
``num_samples``                         ``n`` (sample j of a seeded request draws with ``seed + j``)
``max_tokens``, ``temperature``         the same (temperature 0 = greedy on both sides)
``top_k`` (-1 off), ``top_p``           ``top_k`` (0 off), ``top_p``
``seed`` (any int)                      ``seed`` folded into [0, 2**63) (vLLM's int64)
``stop=None``                           EOS only (vLLM's default)
``stop=[]``                             ``ignore_eos`` (never stops before ``max_tokens``)
``stop=[str, ...]``                     ``stop`` + ``include_stop_str_in_output`` (the completing token last)
``stop=[id, ...]``                      ``stop_token_ids`` (EOS still stops)
``topk_sample_logprobs=k``              ``logprobs=k`` (vLLM adds the sampled token; the k best are kept)
sampled log-probs                       ``logprobs`` entries: vLLM's raw (untempered) log-softmax
``prompt_logprobs``, ``topk_prompt_…``  ``prompt_logprobs=k`` (k = 0: the prompt tokens' own)
stop reasons                            ``finish_reason`` "stop" / "length"
======================================  ===============================================================

What the engine cannot answer is not dropped: :func:`split_request` moves it to ringtune's own forward
(``target_prompt_logprobs``, ``prompt_alt_tokens_k`` always; prompt log-probs when the engine cannot give
them, e.g. vLLM 0.32 started with ``--enable-lora``, where ``prompt_logprobs`` crashes the server), and
:func:`merged_samples` joins the two answers. Token ids come back as ``token_id:<id>`` strings
(``return_tokens_as_token_ids``) and as ``token_ids`` lists (``return_token_ids``), so no text is decoded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest
from ringtune.sample.sampler import PromptSamples, SampledSequence

SEED_MODULUS = 2**63
"""vLLM takes a signed 64-bit seed; Tinker's is any int, folded into [0, 2**63)."""

TOKEN_PREFIX = "token_id:"
"""How vLLM names a token under ``return_tokens_as_token_ids``."""


class EngineAnswerError(RuntimeError):
    """The engine's answer is not what a completion call returns (a server-side fault, never the user's)."""


def split_request(
    request: SampleRequest, *, engine_prompt_logprobs: bool
) -> tuple[SampleRequest, SampleRequest | None]:
    """(what the engine answers, what ringtune's forward answers or None).

    The engine gets the sampling itself (and the prompt log-probs when ``engine_prompt_logprobs``); the forward
    gets a one-token, one-sample copy of ``request`` carrying only the prompt-side asks the engine cannot answer
    (``target_tokens``, ``prompt_alt_tokens_k``, and the prompt log-probs otherwise). Its sampled token is
    discarded by :func:`merged_samples`.
    """
    prompt_asks = request.prompt_logprobs or request.topk_prompt_logprobs > 0
    to_forward = request.target_tokens is not None or request.prompt_alt_tokens_k > 0
    to_forward = to_forward or (prompt_asks and not engine_prompt_logprobs)
    engine = request
    if prompt_asks and not engine_prompt_logprobs:
        engine = replace(engine, prompt_logprobs=False, topk_prompt_logprobs=0, prompt_logprobs_last_n=None)
    engine = replace(engine, target_tokens=None, prompt_alt_tokens_k=0)
    if not to_forward:
        return engine, None
    forward = replace(
        request,
        params=SamplingParams(max_tokens=1, temperature=0.0, seed=request.params.seed),
        num_samples=1,
        topk_sample_logprobs=0,
        prompt_logprobs=request.prompt_logprobs and not engine_prompt_logprobs,
        topk_prompt_logprobs=0 if engine_prompt_logprobs else request.topk_prompt_logprobs,
    )
    return engine, forward


def completion_body(request: SampleRequest, model: str) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for ``request`` on the served ``model`` (the base model's
    served name or a loaded LoRA adapter's name). ``request`` must carry no ``target_tokens`` and no
    ``prompt_alt_tokens_k`` (:func:`split_request` moves them to the forward); ValueError otherwise."""
    if request.target_tokens is not None or request.prompt_alt_tokens_k:
        raise ValueError("target_tokens and prompt_alt_tokens_k are answered by ringtune's forward (split_request)")
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt),
        "n": request.num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 0 if params.top_k == -1 else params.top_k,
        "logprobs": request.topk_sample_logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed % SEED_MODULUS
    if params.stop is not None and not params.stop:
        body["ignore_eos"] = True
    if params.stop_strings:
        body["stop"] = list(params.stop_strings)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if request.prompt_logprobs or request.topk_prompt_logprobs:
        body["prompt_logprobs"] = request.topk_prompt_logprobs
    return body


def token_of(name: Any) -> int:
    """The id of a ``token_id:<id>`` name (EngineAnswerError for anything else)."""
    if not isinstance(name, str) or not name.startswith(TOKEN_PREFIX):
        raise EngineAnswerError(f"token {name!r} is not named '{TOKEN_PREFIX}<id>' (return_tokens_as_token_ids)")
    return int(name[len(TOKEN_PREFIX) :])


def _best(entries: dict[str, Any], k: int) -> list[tuple[int, float]]:
    """The k largest ``(id, logprob)`` of one position's ``top_logprobs`` dict, largest first."""
    pairs = [(token_of(name), float(lp)) for name, lp in entries.items()]
    return sorted(pairs, key=lambda p: -p[1])[:k]


def _sequence(choice: dict[str, Any], k: int) -> SampledSequence:
    """One ``choices`` entry -> a :class:`SampledSequence` (tokens from ``token_ids``, log-probs from
    ``logprobs.token_logprobs``, the k best per token when ``k`` > 0)."""
    tokens = choice.get("token_ids")
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(values) != len(tokens):
        raise EngineAnswerError(f"choice {choice.get('index')}: token_ids and logprobs.token_logprobs must match")
    named = logprobs.get("tokens") or []
    if [token_of(t) for t in named] != tokens:
        raise EngineAnswerError(f"choice {choice.get('index')}: logprobs.tokens disagree with token_ids")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise EngineAnswerError(f"choice {choice.get('index')}: finish_reason={reason!r} (expected stop or length)")
    topk = None
    if k > 0:
        rows = logprobs.get("top_logprobs")
        if not isinstance(rows, list) or len(rows) != len(tokens):
            raise EngineAnswerError(f"choice {choice.get('index')}: logprobs.top_logprobs must have one row per token")
        topk = [_best(row, k) for row in rows]
    return SampledSequence(
        tokens=list(tokens), logprobs=[float(v) for v in values], stop_reason=reason, topk_logprobs=topk
    )


def _prompt_answers(
    choice: dict[str, Any], request: SampleRequest
) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    """The prompt log-probs (entry 0 None) and top-k prompt log-probs of the first choice's ``prompt_logprobs``
    (per position None or ``{"<id>": {"logprob": ...}}``, the prompt token plus the k best)."""
    if not (request.prompt_logprobs or request.topk_prompt_logprobs):
        return None, None
    rows = choice.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(request.prompt):
        raise EngineAnswerError(f"prompt_logprobs: expected {len(request.prompt)} positions, got {rows!r:.200}")
    own: list[float | None] = [None]
    best: list[list[tuple[int, float]] | None] = [None]
    for position, row in enumerate(rows[1:], start=1):
        entries = {int(key): float(value["logprob"]) for key, value in (row or {}).items()}
        token = request.prompt[position]
        if token not in entries:
            raise EngineAnswerError(f"prompt_logprobs[{position}] has no entry for the prompt token {token}")
        own.append(entries[token])
        best.append(sorted(entries.items(), key=lambda p: -p[1])[: request.topk_prompt_logprobs])
    return (own if request.prompt_logprobs else None), (best if request.topk_prompt_logprobs else None)


def prompt_samples(answer: dict[str, Any], request: SampleRequest) -> PromptSamples:
    """The :class:`PromptSamples` of ``request`` from its completion ``answer`` (the parsed JSON): one sequence
    per choice in ``index`` order; EngineAnswerError when the answer is incomplete or malformed."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != request.num_samples:
        raise EngineAnswerError(f"expected {request.num_samples} choices, got {answer!r:.300}")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    sequences = [_sequence(choice, request.topk_sample_logprobs) for choice in choices]
    own, best = _prompt_answers(choices[0], request)
    return PromptSamples(sequences=sequences, prompt_logprobs=own, topk_prompt_logprobs=best)


def merged_samples(engine: PromptSamples, forward: PromptSamples | None) -> PromptSamples:
    """The engine's sequences with the prompt-side answers of ringtune's forward (each taken from the forward
    where it answered it, else the engine's)."""
    if forward is None:
        return engine
    return PromptSamples(
        sequences=engine.sequences,
        prompt_logprobs=forward.prompt_logprobs if forward.prompt_logprobs is not None else engine.prompt_logprobs,
        topk_prompt_logprobs=(
            forward.topk_prompt_logprobs if forward.topk_prompt_logprobs is not None else engine.topk_prompt_logprobs
        ),
        target_prompt_logprobs=forward.target_prompt_logprobs,
        prompt_alt_tokens=forward.prompt_alt_tokens,
    )
