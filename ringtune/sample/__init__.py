"""Sampling: prefill + batched decoding over ringtune's own decoders (see ``generate``)."""

from ringtune.sample.params import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT, SamplingParams
from ringtune.sample.sampler import PromptSamples, SampledSequence, config_eos_token_ids, generate

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_TOKENS_LIMIT",
    "PromptSamples",
    "SampledSequence",
    "SamplingParams",
    "config_eos_token_ids",
    "generate",
]
