"""``ringtune serve``: from the parsed command line to a serving gateway over its worker ranks.

:func:`run_serve` checks the settings (:mod:`ringtune.worker.preflight`: every one against each served model's
config, before any rank starts; the model set against a rank's memory, :mod:`ringtune.worker.model_set`), starts
the backend (one process: :class:`~ringtune.worker.local.LocalBackend`; spawned
ranks on this machine under a supervisor: :func:`~ringtune.worker.launch.start_supervised_workers`; torchrun: every
rank joins, rank 0 serves), prints how to point the SDK at it, and serves until interrupted. The options themselves
are parsed in :mod:`ringtune.cli`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway.backend import Backend
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.server import serve
from ringtune.layout.budget import rank_token_budget
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT
from ringtune.models.config import DecoderConfig
from ringtune.plan.command import parse_memory
from ringtune.worker.device_defaults import DeviceSettings, host_facts, resolve_device_settings
from ringtune.worker.executor import DTYPES, PAD_MULTIPLIER, ModelSpec
from ringtune.worker.launch import (
    WorkerLayout,
    join_torchrun_world,
    start_supervised_workers,
    torchrun_restarts,
)
from ringtune.worker.local import LocalBackend
from ringtune.worker.model_set import (
    ModelArg,
    check_set_fits,
    device_memory_per_rank,
    model_parameters,
    parse_live_runs,
    parse_model_args,
)
from ringtune.worker.preflight import Preflight, ServeSettings, preflight, read_config
from ringtune.worker.vllm_options import engine_configs, start_sampling_engines


def gateway_config(args: argparse.Namespace, root: Path, live_runs: dict[str, int] | None = None) -> GatewayConfig:
    """The gateway's settings from ``serve``'s options (checkpoints under ``root``; ``live_runs``: the served
    models' budgets that differ from ``--max-live-runs``, :func:`parse_live_runs`), validated."""
    config = GatewayConfig(
        checkpoint_root=str(root),
        api_key=args.api_key,
        max_live_runs=args.max_live_runs,
        model_live_runs=tuple((n, k) for n, k in (live_runs or {}).items() if k != args.max_live_runs),
        autosave_every=args.autosave_every,
        autosave_minutes=args.autosave_minutes,
        autosave_keep=args.autosave_keep,
        sample_slice_s=args.sample_slice,
        restore_live_runs=args.restore_live_runs or torchrun_restarts() > 0,
        routing_replay=args.routing_replay,
        lora_pass_runs=args.lora_pass_runs,
        tokenizer_id=args.tokenizer_id,
        max_body_bytes=args.max_body_mb * 2**20,
        fwdbwd_max_chunk_bytes=min(
            args.max_body_mb * 2**20 // 2, GatewayConfig(checkpoint_root="").fwdbwd_max_chunk_bytes
        ),
    )
    config.validate()
    return config


SETTING_OPTIONS = {"source": "model", "gated_delta": "linear_cp_mode", "tokenizer_dir": "tokenizer"}
"""The :class:`ServeSettings` fields whose command-line option has another name (``--model``, ``--linear-cp-mode``,
``--tokenizer``); every other field is the option of its own name."""


def serve_settings(
    args: argparse.Namespace, budget: int, dtype: str, model: ModelArg | None = None, first: bool = True
) -> ServeSettings:
    """What ``serve`` was asked for, for :func:`preflight`: every :class:`ServeSettings` field from its option
    (:data:`SETTING_OPTIONS`), the per-rank token budget ``budget`` and the precision ``dtype`` resolved already
    (``--dtype`` as given, or the device's default); ``model``: the served model it is for (None: ``--model``
    as one value), ``first``: whether it is the first (``--tokenizer`` is the first model's)."""
    given = {
        f.name: getattr(args, SETTING_OPTIONS.get(f.name, f.name))
        for f in fields(ServeSettings)
        if f.name not in ("max_tokens_per_rank", "dtype")
    }
    if model is not None:
        given["source"] = model.source
    if not first:
        given["tokenizer_dir"] = None
    return ServeSettings(**given, max_tokens_per_rank=budget, dtype=dtype)


def trainer_options(args: argparse.Namespace, checked: Preflight) -> dict[str, Any]:
    """The :class:`~ringtune.engine.trainer.Trainer` options of every run: the modes preflight chose, recompute,
    sharding, the debug fault (parity negative controls only), the MoE auxiliary loss weight (UserInputError
    unless finite and >= 0) and ``--freeze-vision``."""
    options: dict[str, Any] = {
        "attention": checked.attention,
        "gated_delta": checked.gated_delta,
        "recompute": args.recompute,
    }
    if args.shard_params != "none":
        options["shard_params"] = args.shard_params
    if args.debug_fault is not None:  # parity negative control (hidden flag)
        options["debug_fault"] = args.debug_fault
    if args.router_aux_loss_coef != 0.0:  # MoE only; checked again (finite, >= 0, MoE model) by the Trainer
        if not (math.isfinite(args.router_aux_loss_coef) and args.router_aux_loss_coef > 0):
            raise UserInputError(f"--router-aux-loss-coef={args.router_aux_loss_coef} must be finite and >= 0")
        options["router_aux_loss_coef"] = args.router_aux_loss_coef
    if getattr(args, "freeze_vision", False):  # a VL model's tower stays as loaded (no-op for a text model)
        options["freeze_vision"] = True
    return options


def ranks_on_this_host(world_size: int) -> int:
    """How many of the job's ``world_size`` ranks share this host's GPUs: torchrun's ``LOCAL_WORLD_SIZE`` when
    it launched us, else all of them (``serve`` spawns every rank on this machine)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)


def start_backend(
    args: argparse.Namespace, specs: list[ModelSpec], root: Path, device: DeviceSettings
) -> Backend | None:
    """The backend rank 0 serves, every model of ``specs`` on the same ranks: under torchrun this rank joins the
    world (None on a worker rank, once it served every command until shutdown); with several ranks on this machine
    they are spawned under a supervisor; else one process. UserInputError for a bad ``--liveness-timeout`` or
    ``--max-restarts``."""
    names = {"tokenizer_dir": args.tokenizer, "tokenizer_cache": root / ".tokenizers"}
    if not args.liveness_timeout > 0:
        raise UserInputError(f"--liveness-timeout={args.liveness_timeout} must be > 0 seconds")
    layout = WorkerLayout(
        dp=args.dp,
        cp=args.cp,
        ep=args.ep,
        timeout_s=args.collective_timeout,
        liveness_timeout_s=args.liveness_timeout,
        device_type=device.device_type,
        data_backend=device.data_backend,
    )
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: every rank runs this
        return join_torchrun_world(specs, layout, **names)
    if layout.world_size > 1:
        if args.max_restarts < 0:
            raise UserInputError(f"--max-restarts={args.max_restarts} must be >= 0")
        return start_supervised_workers(specs, layout, max_restarts=args.max_restarts, **names)
    return LocalBackend.of_specs(specs, **names)


def print_banner(
    args: argparse.Namespace, backend: Backend, checked: Preflight, budget: int, root: Path, device: DeviceSettings
) -> None:
    """What is served and how to point the SDK at it (stdout), a warning when bound beyond loopback without a key."""
    info = backend.info()
    url = f"http://{args.host}:{args.port}"
    print(f"ringtune gateway: {info.model_name} ({info.arch}, {info.dtype}), context {info.context_length} tokens,")
    for other in backend.models()[1:]:
        print(f"  and {other.model_name} ({other.arch}), tokenizer {other.tokenizer_dir}, on the same ranks,")
    print(f"  DP={info.dp_size} x CP={info.cp_size} ranks ({checked.attention} attention, {checked.gated_delta} GDN),")
    print(
        f"  on {device.device_type} ({device.data_backend} data groups, {device.attention_kernel} attention kernel, "
        f"{device.adamw_kernel} AdamW),"
    )
    for note in (*device.notes, *checked.notes):
        print(f"  note: {note}")
    print(f"  {budget} tokens per rank, checkpoints in {root}, tokenizer {info.tokenizer_dir}")
    print(f"  serving on {url}; point the SDK at it with:")
    print(f"  TINKER_BASE_URL={url} TINKER_API_KEY={args.api_key or 'tml-local'}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print("  warning: bound beyond loopback without --api-key: anyone who reaches it can train", file=sys.stderr)
    sys.stdout.flush()


def served_model_args(args: argparse.Namespace) -> list[ModelArg]:
    """The served models of ``--model`` (each a source or NAME=SOURCE; none: the embedded default), with
    ``--model-name`` naming the one model. UserInputError for ``--model-name`` with several models or a named one."""
    models = parse_model_args(args.model, EMBEDDED_DEFAULT)
    if args.model_name is not None:
        if len(models) > 1 or models[0].name is not None:
            raise UserInputError(
                f"--model-name={args.model_name!r} names one unnamed --model; with several give each NAME=SOURCE"
            )
        models = [ModelArg(source=models[0].source, name=args.model_name)]
    return models


def check_memory(
    args: argparse.Namespace,
    models: list[ModelArg],
    configs: list[DecoderConfig],
    live_runs: dict[str, int],
    device: DeviceSettings,
) -> None:
    """Refuse a model set that does not fit a rank (:func:`check_set_fits`): checked with several models, or with
    one when ``--memory-per-rank`` is given. UserInputError naming the set."""
    if len(models) == 1 and args.memory_per_rank is None:
        return
    if args.memory_per_rank is not None:
        memory = parse_memory(args.memory_per_rank, flag="--memory-per-rank")
    else:
        memory = device_memory_per_rank(device.device_type, ranks_on_this_host(args.dp * args.cp))
    params = {m.served_name: model_parameters(c) for m, c in zip(models, configs, strict=True)}
    check_set_fits(params, live_runs, DTYPES[device.dtype].itemsize, memory)


def run_serve(args: argparse.Namespace) -> int:
    """``ringtune serve`` with the parsed ``args``: load the model, print how to point the SDK at the server, then
    serve until interrupted; 0. UserInputError for a setting that cannot serve (the command line answers exit 2)."""
    for name in ("cp", "dp"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name}={getattr(args, name)} must be >= 1")
    context = args.context_length or 8192
    budget = args.max_tokens_per_rank or rank_token_budget(context, args.cp, pad_multiplier=PAD_MULTIPLIER)
    root = Path(args.checkpoint_root).resolve()
    models = served_model_args(args)
    live_runs = parse_live_runs(args.model_live_runs, [m.served_name for m in models], args.max_live_runs)
    config = gateway_config(args, root, live_runs)
    # the host's device decides the defaults (--dtype bf16-mixed on CUDA) and refuses a quadratic-memory fallback
    configs = [read_config(m.source) for m in models]
    devices = [
        resolve_device_settings(
            host_facts(),
            dtype=args.dtype,
            config=c,
            world_size=ranks_on_this_host(args.dp * args.cp),
            max_tokens_per_rank=budget,
        )
        for c in configs
    ]
    device = devices[0]
    # every setting against each model's config, before any rank starts (exit 2 if it cannot serve)
    checks = [preflight(serve_settings(args, budget, device.dtype, m, i == 0)) for i, m in enumerate(models)]
    check_memory(args, models, configs, live_runs, device)
    specs = [
        ModelSpec(
            source=m.source,
            name=m.name,
            dtype=device.dtype,
            device_type=device.device_type,
            max_tokens_per_rank=budget,
            trainer_options=trainer_options(args, checked),
            mesh_prompt_tokens=args.mesh_prompt_tokens,
            record_routing=args.routing_replay,
            shared_decode=args.shared_decode,
        )
        for m, checked in zip(models, checks, strict=True)
    ]
    checked = checks[0]
    # --sampler vllm: each model's engines, their GPUs checked against this host's ranks before any rank starts
    engines = engine_configs(
        args,
        dtype=device.dtype,
        root=root,
        ranks_on_host=ranks_on_this_host(args.dp * args.cp),
        gpus_on_host=host_facts().gpu_count,
    )
    backend = start_backend(args, specs, root, device)
    if backend is None:
        return 0  # a torchrun worker rank: served commands until shutdown
    print_banner(args, backend, checked, budget, root, device)
    # One line per operation (ringtune.gateway.observe) beside uvicorn's own lines.
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sampling_engine = start_sampling_engines(engines, backend)  # --sampler vllm (None: the built-in sampler)
        serve(
            backend, config, host=args.host, port=args.port, log_level=args.log_level, sampling_engine=sampling_engine
        )
    except KeyboardInterrupt:  # uvicorn already shut down gracefully (the backend and workers are closed)
        pass
    return 0
