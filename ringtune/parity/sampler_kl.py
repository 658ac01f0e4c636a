"""KL(sampler ‖ trainer) of one server on its own samples: the on-policy check of ``ringtune parity run``.

With the weights after the parity steps (``save_weights_and_get_sampling_client``), the client samples
:data:`SAMPLE_TOKENS` tokens, :data:`SAMPLES_PER_PROMPT` sequences per prompt, from prompts cut from the parity
datums (the lone 7-token datum, the 17-token short row, and the text rows up to :data:`PROMPT_CAP` tokens: at CP
> 1 the sampler's prefill and the trainer's forward both split them over the ranks). It then forwards each
prompt + completion on the trainer (``forward``, cross_entropy, weights 0) and compares, token by token, the
sampler's log-prob of each sampled token with the trainer's.

Per sampled token ``x ~ sampler``, with ``Δ = lp_trainer(x) - lp_sampler(x)``:

- ``k1 = mean(-Δ)``: the plain estimate of KL(sampler ‖ trainer) (unbiased, can be negative);
- ``k3 = mean(e^Δ - 1 - Δ)``: never negative, ≈ Δ²/2 per token (the estimator RL recipes log as the
  sampler/trainer mismatch); this is the figure ``parity compare`` gates;
- ``max_abs = max |Δ|``.

Both sides run the same model on the same weights, so Δ is the difference between the decode path (prefill,
then one token at a time with caches) and the packed training forward: summation order only, unless a layout
or the weight hand-off to the sampler is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tinker

from ringtune.parity.datums import DatumSet

SAMPLE_TOKENS = 16
SAMPLES_PER_PROMPT = 2
PROMPT_CAP = 256
"""Longest prompt (tokens): long enough for every zigzag chunk at CP=4 to hold part of it."""


def sampler_prompts(data: DatumSet, context_length: int) -> list[tuple[str, list[int]]]:
    """(name, token ids) of each prompt: the lone datum, the longest short row, each text row cut to
    ``min(PROMPT_CAP, context_length - SAMPLE_TOKENS)`` tokens."""
    cap = min(PROMPT_CAP, context_length - SAMPLE_TOKENS)
    if cap < 1:
        raise ValueError(f"context_length={context_length}: no room for a prompt and {SAMPLE_TOKENS} sampled tokens")
    shorts = [d for d in data.main if d.kind == "short"]
    chosen = [data.lone, *([max(shorts, key=lambda d: len(d.tokens))] if shorts else [])]
    chosen += [d for d in data.main if d.kind == "text"]
    return [(d.name, list(d.tokens[:cap])) for d in chosen]


def skipped_sampler_kl(reason: str) -> dict[str, Any]:
    """The dump's ``sampler_kl`` entry of a server that was not measured."""
    return {"status": "skipped", "reason": reason}


def kl_estimates(sampler_lp: np.ndarray, trainer_lp: np.ndarray) -> dict[str, float]:
    """k1, k3 and max |Δ| (module docstring) of the sampled tokens' log-probs, two float64 arrays [N]."""
    if sampler_lp.shape != trainer_lp.shape or sampler_lp.size == 0:
        raise ValueError(f"log-prob arrays must match and be non-empty; got {sampler_lp.shape} and {trainer_lp.shape}")
    delta = trainer_lp - sampler_lp
    return {
        "k1": float(np.mean(-delta)),
        "k3": float(np.mean(np.expm1(delta) - delta)),
        "max_abs": float(np.max(np.abs(delta))),
    }


def measure_sampler_kl(
    tc: tinker.TrainingClient, prompts: Sequence[tuple[str, list[int]]], *, seed: int
) -> dict[str, Any]:
    """Sample from ``tc``'s current weights, forward the samples on ``tc``, return the dump's ``sampler_kl``.

    Sequences that stop before :data:`SAMPLE_TOKENS` (an end-of-sequence token) count with the tokens they have.
    """
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = tinker.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=seed, stop=[])
    futures = [
        sampler.sample(tinker.ModelInput.from_ints(tokens), num_samples=SAMPLES_PER_PROMPT, sampling_params=params)
        for _, tokens in prompts
    ]
    datums, sampled = [], []
    for (name, prompt), future in zip(prompts, futures, strict=True):
        for seq in future.result().sequences:
            if not seq.tokens:
                continue
            if seq.logprobs is None or len(seq.logprobs) != len(seq.tokens):
                raise ValueError(
                    f"prompt {name}: the sampler returned {len(seq.tokens)} tokens without their log-probs"
                )
            full = prompt + list(seq.tokens)
            datums.append(
                tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
                )
            )
            sampled.append((len(prompt), np.asarray(seq.logprobs, dtype=np.float64)))
    if not datums:
        return skipped_sampler_kl("every sampled sequence was empty")
    outputs = tc.forward(datums, "cross_entropy").result().loss_fn_outputs
    trainer = [o["logprobs"].to_torch().double().numpy()[n - 1 :] for o, (n, _) in zip(outputs, sampled, strict=True)]
    estimates = kl_estimates(np.concatenate([s for _, s in sampled]), np.concatenate(trainer))
    return {
        "status": "measured",
        "weights": "after the parity steps",
        "prompts": {name: len(tokens) for name, tokens in prompts},
        "sequences": len(datums),
        "tokens": int(sum(s.size for _, s in sampled)),
        "seed": seed,
        **estimates,
    }
