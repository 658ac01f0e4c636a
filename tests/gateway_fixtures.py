"""Shared pieces of the gateway tests: a tiny random Qwen3.5 checkpoint with a word-level tokenizer, and a
live gateway over it (uvicorn in a thread on 127.0.0.1, a free port)."""

from __future__ import annotations

import json
from pathlib import Path

from support.tiny_models import hf_model
from tokenizers import Tokenizer, models, pre_tokenizers

from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.local import LocalBackend
from ringtune.gateway.server import ServerThread

API_KEY = "tml-test"
MODEL_NAME = "tiny/qwen3.5-random"
MAX_TOKENS_PER_RANK = 64
"""Small enough that a request of a few datums spans several microbatches."""


def tiny_model_dir(dest: Path) -> Path:
    """``hf_model("qwen3_5", seed=0)`` saved to ``dest`` plus a 96-word tokenizer (``w0`` .. ``w95``)."""
    hf_model("qwen3_5", seed=0).save_pretrained(dest)
    vocab = {f"w{i}": i for i in range(96)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "w95", "pad_token": "w94", "unk_token": "w0"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def start_gateway(root: Path, model_dir: Path, **settings: object) -> ServerThread:
    """A started gateway over a :class:`LocalBackend` of ``model_dir`` (float32), checkpoints under ``root``."""
    backend = LocalBackend(str(model_dir), max_tokens_per_rank=MAX_TOKENS_PER_RANK, model_name=MODEL_NAME)
    options = {"checkpoint_root": str(root), "api_key": API_KEY, "poll_timeout_s": 5.0} | settings
    server = ServerThread(backend, GatewayConfig(**options))  # type: ignore[arg-type]
    server.start()
    return server
