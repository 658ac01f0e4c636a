"""The set of base models ``ringtune serve`` loads (``--model`` once or more) and whether the set fits a rank.

Each ``--model`` value is a source (an HF checkpoint directory, a ``.gguf`` file or the embedded default's name)
or ``NAME=SOURCE``: clients pass ``NAME`` as ``base_model`` (the source path is accepted too). Every served model
has its own memory budget: ``--max-live-runs N`` full fine-tuning runs of that model (``--model-live-runs
NAME=N`` for one model, 0 for a model that is only sampled, e.g. a distillation teacher).

What a rank may hold for the set (replicated layout; ``--shard-params`` only makes it smaller), in bytes::

    Σ over models m of (1 + STATE_COPIES · N_m) · P_m · b

P_m the model's parameters (from its config, as ``ringtune plan`` counts them), b the bytes of a parameter in
``--dtype``, N_m its budget, STATE_COPIES weights + gradients + two AdamW moments
(:mod:`ringtune.gateway.run_memory`); the 1 is the base every model keeps (its sampler, its LoRA runs' frozen base).
:func:`check_set_fits` refuses a set above the memory of a rank (``--memory-per-rank``, else the device's: a
GPU's memory over the ranks sharing it, or the host's over its ranks) before anything loads, naming every model and
its share. Activations and sampler snapshots come on top (``ringtune plan`` predicts them); with one model the
check runs only when ``--memory-per-rank`` is given (one model is served as before).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ringtune.errors import UserInputError
from ringtune.gateway.run_memory import STATE_COPIES
from ringtune.models.config import DecoderConfig
from ringtune.plan.gpu_split import model_parameters as plan_model_parameters

GIB = 2**30


@dataclass(frozen=True)
class ModelArg:
    """One ``--model`` value: ``source`` (what is loaded) and ``name`` (``NAME=`` given, else None: the source)."""

    source: str
    name: str | None = None

    @property
    def served_name(self) -> str:
        """The name clients pass as ``base_model``."""
        return self.name or self.source


def parse_model_args(values: Sequence[str] | None, default: str) -> list[ModelArg]:
    """The ``--model`` values (None: ``[default]``) as :class:`ModelArg`, in order. ``NAME=SOURCE`` when the text
    before the first ``=`` is a plain name (no ``/``) and the whole value is no existing path. UserInputError for
    an empty name or source, or two models with one name."""
    parsed = []
    for value in values or [default]:
        name, sep, source = value.partition("=")
        if sep and "/" not in name and not Path(value).exists():
            if not name or not source:
                raise UserInputError(f"--model={value!r}: expected a source or NAME=SOURCE with both non-empty")
            parsed.append(ModelArg(source=source, name=name))
        else:
            parsed.append(ModelArg(source=value))
    names = [m.served_name for m in parsed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserInputError(f"--model: the name(s) {twice} are given twice; name each model (--model NAME=SOURCE)")
    return parsed


def parse_live_runs(values: Sequence[str] | None, names: Sequence[str], default: int) -> dict[str, int]:
    """Each served model's budget in full fine-tuning runs of that model: ``default`` (``--max-live-runs``) unless
    ``--model-live-runs NAME=N`` (N >= 0) names it. UserInputError for a malformed value or an unknown name."""
    budgets = dict.fromkeys(names, default)
    for value in values or []:
        name, _, count = value.rpartition("=")
        if name not in budgets:
            raise UserInputError(f"--model-live-runs={value!r}: expected NAME=N with NAME one of {list(names)}")
        try:
            budgets[name] = int(count)
        except ValueError:
            raise UserInputError(f"--model-live-runs={value!r}: N must be an integer >= 0") from None
        if budgets[name] < 0:
            raise UserInputError(f"--model-live-runs={value!r}: N must be >= 0")
    return budgets


def model_parameters(config: DecoderConfig) -> int:
    """Parameters of a model of ``config`` (every layer, its routed experts, embeddings and head), as ``ringtune
    plan`` counts them (:func:`ringtune.plan.gpu_split.model_parameters`)."""
    return plan_model_parameters(config)


def device_memory_per_rank(device_type: str, ranks_on_host: int) -> int:
    """Bytes of memory one rank may use: on CUDA the smallest GPU's over the ranks that share it (ranks
    round-robin over the host's GPUs), on the CPU the host's physical memory over its ranks."""
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        return smallest // -(-ranks_on_host // gpus)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_on_host


def set_bytes(params: dict[str, int], live_runs: dict[str, int], bytes_per_param: int) -> dict[str, int]:
    """Per model name, the bytes a rank may hold for it (module docstring): ``(1 + STATE_COPIES·N)·P·b``."""
    return {name: (1 + STATE_COPIES * live_runs[name]) * p * bytes_per_param for name, p in params.items()}


def check_set_fits(params: dict[str, int], live_runs: dict[str, int], bytes_per_param: int, memory: int) -> None:
    """UserInputError naming the set, each model's share and the fix when the models of ``params`` (name ->
    parameters) at their budgets ``live_runs`` need more than ``memory`` bytes per rank."""
    shares = set_bytes(params, live_runs, bytes_per_param)
    need = sum(shares.values())
    if need <= memory:
        return
    parts = ", ".join(
        f"{name} ({params[name] / 1e6:.1f}M parameters, {live_runs[name]} live run(s): {shares[name] / GIB:.2f} GiB)"
        for name in params
    )
    raise UserInputError(
        f"the model set {list(params)} does not fit: {parts} need {need / GIB:.2f} GiB per rank, more than the "
        f"{memory / GIB:.2f} GiB a rank has (--memory-per-rank or the device's); lower --max-live-runs or a model's "
        "--model-live-runs NAME=N (0 for a model that is only sampled), or serve fewer or smaller models"
    )
