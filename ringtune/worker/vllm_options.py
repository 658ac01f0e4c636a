"""``ringtune serve --sampler vllm``: the command-line options of the external sampling engine and the engine
they start (:mod:`ringtune.worker.vllm_engine`).

``--sampler builtin`` (the default) samples on ringtune's own decoders (docs/sampling.md). ``--sampler vllm``
starts a vLLM server on the served base model (or attaches to ``--vllm-url``) and answers every sampling
session there (:mod:`ringtune.gateway.vllm_sampling`); training stays on ringtune's ranks.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from ringtune.errors import UserInputError
from ringtune.gateway.backend import Backend
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT
from ringtune.worker.model_set import parse_model_args
from ringtune.worker.vllm_engine import VllmEngine, VllmEngineConfig, engine_log_path

SAMPLERS = ("builtin", "vllm")

PYTHON_ENV = "RINGTUNE_VLLM_PYTHON"
"""The environment variable naming the engine's interpreter when ``--vllm-python`` is not given."""

ENGINE_DTYPES = {"float32": "float32", "float64": "float32", "bfloat16": "bfloat16", "float16": "float16"}
"""The engine's ``--dtype`` for a ringtune precision (vLLM has no float64; bf16-mixed/-exact serve bfloat16)."""


def add_sampler_options(p: argparse.ArgumentParser) -> None:
    """``serve``'s ``--sampler`` and ``--vllm-*`` options."""
    p.add_argument(
        "--sampler",
        default="builtin",
        choices=SAMPLERS,
        help="who answers sampling: ringtune's own decoders (builtin) or a vLLM server it starts or attaches to "
        "(vllm; docs/sampling.md, 'Sampling on vLLM')",
    )
    p.add_argument("--vllm-url", default=None, help="--sampler vllm: attach to this running engine, start none")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get(PYTHON_ENV) or sys.executable,
        help=f"--sampler vllm: the interpreter with vLLM installed (default: ${PYTHON_ENV}, else this one)",
    )
    p.add_argument(
        "--vllm-args",
        default="",
        help="--sampler vllm: more vllm.entrypoints.openai.api_server arguments, one string given with '=' (e.g. "
        "--vllm-args=--enforce-eager on CPU, --vllm-args='--tensor-parallel-size 2' on GPUs)",
    )
    p.add_argument(
        "--vllm-lora",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--sampler vllm: LoRA runs as runtime adapters on the engine (prompt log-probs then come from ringtune's "
        "forward); --no-vllm-lora: LoRA exports are reloaded as merged weights",
    )
    p.add_argument("--vllm-max-lora-rank", type=int, default=64, help="--sampler vllm: largest LoRA rank served")
    p.add_argument(
        "--vllm-devices",
        default=None,
        help="--sampler vllm: the engine's CUDA_VISIBLE_DEVICES (e.g. '4,5,6,7': GPUs the training ranks do not "
        "use; docs/operations.md, 'A sampling engine beside the ranks')",
    )


SERVED_NAME = "ringtune-base"
"""The engine's name of the base model (only ringtune's completion calls use it; clients name ``--model-name``)."""


def engine_config(args: argparse.Namespace, *, dtype: str, root: Path) -> VllmEngineConfig | None:
    """The :class:`VllmEngineConfig` of ``--sampler vllm`` (None for ``builtin``), its ``max_model_len`` set by
    :func:`start_sampling_engine` to the served context. UserInputError when ``--model`` is not an HF checkpoint
    directory (vLLM loads the base from it) or ``--vllm-max-lora-rank`` < 1."""
    if args.sampler == "builtin":
        return None
    models = parse_model_args(args.model, EMBEDDED_DEFAULT)
    if len(models) > 1:
        raise UserInputError(
            f"--sampler vllm: {len(models)} --model values given, but the engine serves one base model; serve "
            "several base models with --sampler builtin"
        )
    model = Path(models[0].source)
    if not (model / "config.json").is_file():
        raise UserInputError(
            f"--sampler vllm: --model={models[0].source!r} must be an HF checkpoint directory (vLLM loads the base "
            "model from it); GGUF files and embedded names are served by --sampler builtin only"
        )
    if args.vllm_max_lora_rank < 1:
        raise UserInputError(f"--vllm-max-lora-rank={args.vllm_max_lora_rank} must be >= 1")
    extra = shlex.split(args.vllm_args)
    if args.tokenizer and "--tokenizer" not in extra:
        extra += ["--tokenizer", str(Path(args.tokenizer).resolve())]
    return VllmEngineConfig(
        model=str(model.resolve()),
        served_name=SERVED_NAME,
        python=args.vllm_python,
        url=args.vllm_url,
        dtype=ENGINE_DTYPES.get(dtype, "bfloat16"),
        enable_lora=args.vllm_lora,
        max_lora_rank=args.vllm_max_lora_rank,
        extra_args=tuple(extra),
        env={} if args.vllm_devices is None else {"CUDA_VISIBLE_DEVICES": args.vllm_devices},
        log_path=engine_log_path(root),
    )


def start_sampling_engine(config: VllmEngineConfig | None, backend: Backend) -> VllmEngine | None:
    """The started (or attached) engine of ``config`` for the served ``backend`` (its context length), healthy;
    None for ``--sampler builtin``. If it cannot start, the backend is closed and EngineUnavailableError raised."""
    if config is None:
        return None
    config = replace(config, max_model_len=backend.info().context_length)
    engine = VllmEngine(config)
    print(f"ringtune: starting the vLLM sampler ({config.python}; log {config.log_path}) ...", flush=True)
    try:
        engine.start()
    except BaseException:
        engine.stop()
        backend.close()
        raise
    print(f"ringtune: vLLM sampler serving {config.served_name} at {engine.url}", flush=True)
    return engine
