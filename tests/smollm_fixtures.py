"""A tiny random Llama with SmolLM2's real 49,152-token vocabulary and tokenizer, as an HF directory.

Chat text (the demo's ChatML, the cookbook's renderers) tokenizes as it would for SmolLM2-135M, while a
step costs milliseconds: 4 layers of hidden size 32 (about 3.2 M parameters, almost all embeddings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support.tiny_models import hf_config

from ringtune.gateway.serve_process import ServeProcess
from ringtune.models.checkpoints.tokenizers import SMOLLM2_VOCAB, smollm2_tokenizer_dir


def tiny_smollm_dir(dest: Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (random, float32) and SmolLM2's tokenizer files to ``dest``.
    ``overrides``: config fields replaced (e.g. ``hidden_size=128, head_dim=32`` for vLLM's CPU attention)."""
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(_smollm_config("llama", **overrides)).save_pretrained(dest)
    smollm2_tokenizer_dir(dest)
    return dest


def tiny_smollm_class_dir(dest: Path, *, seed: int = 0, scale: float = 12.0, **overrides: object) -> Path:
    """:func:`tiny_smollm_dir` with one learnable direction shared by a class of tokens, so that RL on a reward
    over that class has something to learn in a few steps (a random model's tokens share nothing).

    Every input embedding gets +1 on hidden dims 0 and 1, so the final norm's output holds a nearly constant
    ``c`` on both at every position; the unembedding row of every token whose text holds no ASCII letter gets
    ``+scale`` on dim 0 and ``-scale`` on dim 1. At start the two cancel (logits as random as before); a gradient
    that favours those tokens moves the final norm's weights of dims 0 and 1 apart, which raises all of them.
    """
    import transformers
    from safetensors.torch import load_file, save_file

    tiny_smollm_dir(dest, seed=seed, **overrides)
    weights = load_file(dest / "model.safetensors")
    tokenizer = transformers.AutoTokenizer.from_pretrained(dest)
    no_letters = [
        i for i in range(SMOLLM2_VOCAB) if not any(c.isascii() and c.isalpha() for c in tokenizer.decode([i]))
    ]
    weights["model.embed_tokens.weight"][:, :2] += 1.0
    head = weights["lm_head.weight"]
    head[no_letters, 0] += scale
    head[no_letters, 1] -= scale
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def tiny_smollm_class_teacher_dir(dest: Path, *, seed: int = 0, scale: float = 12.0, shift: float = 0.05) -> Path:
    """:func:`tiny_smollm_class_dir` (same ``seed`` and ``scale``, so the same weights) with its class direction
    switched on: the final norm's weight of hidden dim 0 raised by ``shift`` and of dim 1 lowered by ``shift``.

    Every token without ASCII letters then gains about ``2 * shift * scale * c`` in logit at every position
    (``c`` the nearly constant norm output on dims 0 and 1), so this model prefers that class where the balanced
    one does not. A teacher for a student built by :func:`tiny_smollm_class_dir`: the two differ in two weights,
    and the student reaches the teacher exactly by moving those two, or by a rank-2 change of its unembedding
    (columns 0 and 1 scaled), which a LoRA adapter on ``lm_head`` can hold.
    """
    from safetensors.torch import load_file, save_file

    tiny_smollm_class_dir(dest, seed=seed, scale=scale)
    weights = load_file(dest / "model.safetensors")
    weights["model.norm.weight"][0] += shift
    weights["model.norm.weight"][1] -= shift
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _smollm_config(family: str, **overrides: object):
    """The tiny ``family`` config (``overrides`` replacing its fields) with SmolLM2's vocabulary and special
    token ids."""
    config = hf_config(family, **overrides)
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
def cookbook_server(
    root: Path,
    *,
    api_key: str,
    context_length: int,
    extra_args: tuple[str, ...] = (),
    make_model: Callable[[Path], Path] = tiny_smollm_dir,
) -> Iterator[dict]:
    """``ringtune serve`` over :func:`tiny_smollm_dir` in ``root``, with the environment the cookbook reads
    (``HF_HUB_OFFLINE=1``, ``TINKER_API_KEY``) set for the duration; yields url, model_dir, root and the process.
    ``extra_args``: more ``serve`` arguments (``--cp 2``, ``--model-name ...``); ``make_model`` writes the model."""
    model_dir = make_model(root / "models" / "tiny-smollm")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("TINKER_API_KEY", api_key)
        proc = ServeProcess(
            str(model_dir),
            checkpoint_root=root / "checkpoints",
            log_path=root / "server.log",
            api_key=api_key,
            extra_args=["--context-length", str(context_length), *extra_args],
        )
        with proc:
            yield {"url": proc.url, "model_dir": model_dir, "root": root, "proc": proc}
