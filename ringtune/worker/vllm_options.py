"""``ringtune serve --sampler vllm``: the command-line options of the external sampling engine and the engine
they start (:mod:`ringtune.worker.vllm_engine`).

``--sampler builtin`` (the default) samples on ringtune's own decoders (docs/sampling.md). ``--sampler vllm``
starts vLLM servers on the served base models (or attaches to ``--vllm-url``) and answers every sampling
session there (:mod:`ringtune.gateway.vllm_sampling`); training stays on ringtune's ranks.

Engines per served model (``--model``, once or more): ``--vllm-engines N`` started ones (default 1 for a model
no ``--vllm-url`` names, else 0) plus the attached ones, ``--vllm-url [MODEL=]URL`` repeated (with several
models each URL names its model). ``--vllm-devices`` lists the started engines' GPUs, split evenly over them in
order (:mod:`ringtune.worker.vllm_devices` checks the split against the training ranks and the engines'
tensor parallelism).
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
from ringtune.worker.vllm_devices import engine_devices
from ringtune.worker.vllm_engine import VllmEngine, VllmEngineConfig, engine_log_path, start_engines

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
    p.add_argument(
        "--vllm-url",
        action="append",
        default=None,
        help="--sampler vllm: attach to this running engine ([MODEL=]URL; repeat for several; with several --model "
        "each names its model); a model with a URL starts no engine unless --vllm-engines says so",
    )
    p.add_argument(
        "--vllm-engines",
        type=int,
        default=None,
        help="--sampler vllm: engines ringtune starts per served model (default 1, or 0 for a model with a "
        "--vllm-url); sessions spread over them (docs/sampling.md, 'Several engines')",
    )
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
        help="--sampler vllm: the started engines' GPUs, split evenly over them in order (e.g. '4,5,6,7': GPUs the "
        "training ranks do not use; 2 engines get 4,5 and 6,7; docs/operations.md, 'Sampling engines beside the "
        "ranks')",
    )


SILENT_AFTER_S = 30.0
"""How long a live engine may leave ``/health`` unanswered before ``serve`` restarts it (several engines starting
on one host can starve a serving one of CPU for seconds)."""

SERVED_NAME = "ringtune-base"
"""The engine's name of the base model (only ringtune's completion calls use it; clients name ``--model-name``)."""


def attached_urls(values: list[str] | None, models: list[str]) -> dict[str, list[str]]:
    """Each served model's ``--vllm-url`` engines: ``MODEL=URL`` names the model; a bare URL belongs to the only
    model. UserInputError for a bare URL with several models, an unknown model name, or a value that is no
    http(s) URL."""
    urls: dict[str, list[str]] = {m: [] for m in models}
    for value in values or []:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            name, url = "", value
        if not url.startswith(("http://", "https://")):
            raise UserInputError(f"--vllm-url={value!r}: expected [MODEL=]http://host:port")
        if not name:
            if len(models) > 1:
                raise UserInputError(
                    f"--vllm-url={value!r}: {len(models)} models are served; name the model it serves "
                    f"(--vllm-url MODEL=URL, MODEL one of {models})"
                )
            name = models[0]
        if name not in urls:
            raise UserInputError(f"--vllm-url={value!r}: {name!r} is not a served model; choose one of {models}")
        urls[name].append(url)
    return urls


def engine_configs(
    args: argparse.Namespace,
    *,
    dtype: str,
    root: Path,
    ranks_on_host: int | None = None,
    gpus_on_host: int | None = None,
) -> dict[str, list[VllmEngineConfig]]:
    """Each served model's engine configs for ``--sampler vllm`` (attached ones first, then the started ones;
    empty for ``builtin``), their ``max_model_len`` set by :func:`start_sampling_engines` to the model's context.
    ``ranks_on_host`` / ``gpus_on_host``: the training ranks and GPUs of this host (None: unknown, not checked).
    UserInputError when a ``--model`` is not an HF checkpoint directory (vLLM loads the base from it),
    ``--vllm-max-lora-rank`` < 1, ``--vllm-engines`` < 0, a model ends with no engine, or ``--vllm-devices`` does
    not split over the started engines (:func:`~ringtune.worker.vllm_devices.engine_devices`)."""
    if args.sampler == "builtin":
        return {}
    models = parse_model_args(args.model, EMBEDDED_DEFAULT)
    for m in models:
        if not (Path(m.source) / "config.json").is_file():
            raise UserInputError(
                f"--sampler vllm: --model={m.source!r} must be an HF checkpoint directory (vLLM loads the base "
                "model from it); GGUF files and embedded names are served by --sampler builtin only"
            )
    if args.vllm_max_lora_rank < 1:
        raise UserInputError(f"--vllm-max-lora-rank={args.vllm_max_lora_rank} must be >= 1")
    if args.vllm_engines is not None and args.vllm_engines < 0:
        raise UserInputError(f"--vllm-engines={args.vllm_engines} must be >= 0")
    names = [m.served_name for m in models]
    urls = attached_urls(args.vllm_url, names)
    started = {n: (1 if not urls[n] else 0) if args.vllm_engines is None else args.vllm_engines for n in names}
    for n in names:
        if not urls[n] and not started[n]:
            raise UserInputError(f"--vllm-engines=0: model {n!r} has no --vllm-url either, so nothing samples it")
    extra = shlex.split(args.vllm_args)
    if args.tokenizer and "--tokenizer" not in extra:
        extra += ["--tokenizer", str(Path(args.tokenizer).resolve())]
    devices = engine_devices(
        args.vllm_devices, sum(started.values()), extra, ranks_on_host=ranks_on_host, gpus_on_host=gpus_on_host
    )
    base = VllmEngineConfig(
        model="",
        served_name=SERVED_NAME,
        python=args.vllm_python,
        dtype=ENGINE_DTYPES.get(dtype, "bfloat16"),
        enable_lora=args.vllm_lora,
        max_lora_rank=args.vllm_max_lora_rank,
        extra_args=tuple(extra),
        silent_after_s=SILENT_AFTER_S,
    )
    configs: dict[str, list[VllmEngineConfig]] = {}
    for m in models:
        model = replace(base, model=str(Path(m.source).resolve()))
        label = "engine" if len(models) == 1 else f"engine-{_file_name(m.served_name)}"
        group = [replace(model, url=url) for url in urls[m.served_name]]
        for i in range(started[m.served_name]):
            visible = devices.pop(0) if devices else None
            suffix = "" if started[m.served_name] == 1 and len(models) == 1 else f"-{i}"
            group.append(
                replace(
                    model,
                    env={} if visible is None else {"CUDA_VISIBLE_DEVICES": visible},
                    log_path=engine_log_path(root, f"{label}{suffix}"),
                )
            )
        configs[m.served_name] = group
    return configs


def _file_name(text: str) -> str:
    """``text`` with every character but letters, digits, ``-``, ``_`` and ``.`` replaced by ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def start_sampling_engines(
    configs: dict[str, list[VllmEngineConfig]], backend: Backend
) -> dict[str, list[VllmEngine]] | None:
    """The started (or attached) engines of ``configs`` (served model -> its engines) for the served ``backend``
    (each model's context length), healthy, started side by side; None for ``--sampler builtin``. If one cannot
    start, every engine is stopped, the backend closed and EngineUnavailableError raised."""
    if not configs:
        return None
    contexts = {info.model_name: info.context_length for info in backend.models()}
    engines = {
        name: [VllmEngine(replace(c, max_model_len=contexts.get(name, backend.info().context_length))) for c in group]
        for name, group in configs.items()
    }
    every = [engine for group in engines.values() for engine in group]
    for engine in every:
        where = engine.config.url or f"log {engine.config.log_path}"
        print(f"ringtune: starting a vLLM sampler for {engine.config.model} ({where}) ...", flush=True)
    try:
        start_engines(every)
    except BaseException:
        for engine in every:
            engine.stop()
        backend.close()
        raise
    for name, group in engines.items():
        print(f"ringtune: vLLM sampler(s) for {name}: {', '.join(e.url for e in group)}", flush=True)
    return engines
