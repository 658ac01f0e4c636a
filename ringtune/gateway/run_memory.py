"""Admission of training runs by the memory their state holds, not by their number (``--max-live-runs``).

Every rank holds, per run, its trainable parameters four times (weights, gradients, two AdamW moments): a full
fine-tuning run ``4·P`` (P = the served model's parameters), a LoRA run ``4·L`` (L = its adapters' parameters,
``rank × Σ`` of its target groups' per-rank counts, :attr:`BackendInfo.lora_params_per_rank`), plus the frozen
base once (``P``) while any LoRA run is live (every LoRA run shares it). ``max_live_runs`` is the budget in
full-run equivalents: ``max_live_runs × 4·P``. So the default 4 admits four full fine-tuning runs as before, or
``(16·P − P) / (4·L)`` LoRA runs (44 of rank 32 on SmolLM2-135M). When the backend does not report ``P``
(``param_count`` 0), runs are counted as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway.backend import BackendInfo

STATE_COPIES = 4
"""Weights, gradients and the two AdamW moments of every trainable parameter."""


def run_params(info: BackendInfo, lora: Mapping[str, Any] | None) -> int:
    """Trainable parameters of a run (full: the model's; LoRA: its adapters')."""
    if lora is None:
        return info.param_count
    groups = info.lora_params_per_rank
    chosen = [g for g in ("attn", "mlp", "unembed") if lora.get(f"train_{g}")]
    return int(lora["rank"]) * sum(groups.get(g, 0) for g in chosen)


def held_params(info: BackendInfo, runs: Iterable[Mapping[str, Any] | None]) -> int:
    """Parameters a rank holds for ``runs`` (each a LoRA spec dict or None): their state plus the shared base."""
    specs = list(runs)
    base = info.param_count if any(s is not None for s in specs) else 0
    return base + STATE_COPIES * sum(run_params(info, s) for s in specs)


def check_admission(
    info: BackendInfo, live: Iterable[Mapping[str, Any] | None], new: Mapping[str, Any] | None, max_live_runs: int
) -> None:
    """UserInputError when one more run (``new``) would exceed the budget; ``live``: the live runs' specs."""
    specs = list(live)
    if info.param_count <= 0:
        if len(specs) >= max_live_runs:
            raise UserInputError(
                f"{len(specs)} training runs are live, the limit is {max_live_runs} (max_live_runs); "
                "finish a session (ServiceClient.close) to free its runs"
            )
        return
    budget = max_live_runs * STATE_COPIES * info.param_count
    held, after = held_params(info, specs), held_params(info, [*specs, new])
    if after > budget:
        kind = "full fine-tuning run" if new is None else f"LoRA run of rank {new['rank']}"
        raise UserInputError(
            f"a {kind} needs {(after - held) / 1e6:.2f}M parameters of state per rank and {held / 1e6:.2f}M of "
            f"{budget / 1e6:.2f}M are held by {len(specs)} live runs: the limit is {max_live_runs} full-run "
            "equivalents (max_live_runs); finish a session (ServiceClient.close) to free its runs"
        )
