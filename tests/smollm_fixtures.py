"""A tiny random Llama with SmolLM2's real 49,152-token vocabulary and tokenizer, as an HF directory.

Chat text (the demo's ChatML, the cookbook's renderers) tokenizes as it would for SmolLM2-135M, while a
step costs milliseconds: 4 layers of hidden size 32 (about 3.2 M parameters, almost all embeddings).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support.tiny_models import hf_config

from ringtune.gateway.serve_process import ServeProcess
from ringtune.models.checkpoints.tokenizers import SMOLLM2_VOCAB, smollm2_tokenizer_dir


def tiny_smollm_dir(dest: Path, *, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (random, float32) and SmolLM2's tokenizer files to ``dest``."""
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(_smollm_config("llama")).save_pretrained(dest)
    smollm2_tokenizer_dir(dest)
    return dest


def _smollm_config(family: str):
    """The tiny ``family`` config with SmolLM2's vocabulary and special token ids."""
    config = hf_config(family)
    config.vocab_size = SMOLLM2_VOCAB
    config.max_position_embeddings = 4096
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, None
    return config


def tiny_smollm_moe_dir(dest: Path, *, seed: int = 0) -> Path:
    """A random tiny Qwen3.5-MoE (``hf_config("qwen3_5_moe")``, routers at std 0.5) with SmolLM2's tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(_smollm_config("qwen3_5_moe"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # routing that differs per token
    model.save_pretrained(dest)
    smollm2_tokenizer_dir(dest)
    return dest


@contextmanager
def cookbook_server(root: Path, *, api_key: str, context_length: int) -> Iterator[dict]:
    """``ringtune serve`` over :func:`tiny_smollm_dir` in ``root``, with the environment the cookbook reads
    (``HF_HUB_OFFLINE=1``, ``TINKER_API_KEY``) set for the duration; yields url, model_dir, root and the process."""
    model_dir = tiny_smollm_dir(root / "models" / "tiny-smollm")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("TINKER_API_KEY", api_key)
        proc = ServeProcess(
            str(model_dir),
            checkpoint_root=root / "checkpoints",
            log_path=root / "server.log",
            api_key=api_key,
            extra_args=["--context-length", str(context_length)],
        )
        with proc:
            yield {"url": proc.url, "model_dir": model_dir, "root": root, "proc": proc}
