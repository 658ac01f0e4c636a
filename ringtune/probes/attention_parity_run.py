"""``ringtune attention-parity``: run the attention parity probe on spawned gloo ranks and print a table."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ringtune.ops.cp_modes import ATTENTION_MODES
from ringtune.parallel.launch import init_from_env, spawn
from ringtune.parallel.mesh import build_mesh
from ringtune.probes.attention_parity import FIELDS, AttentionShape, compare_attention
from ringtune.probes.scenarios import SCENARIOS

# Limits the probe enforces per dtype (same reasoning as tests/test_attention_cp.py).
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2}


@dataclass(frozen=True, kw_only=True)
class AttentionParityConfig:
    """What ``ringtune attention-parity`` runs; one field per command-line flag."""

    cp: int = 2
    modes: tuple[str, ...] = ATTENTION_MODES
    dtype: str = "float64"
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    shape: AttentionShape = field(default_factory=AttentionShape)
    seed: int = 0


def _rank_main(rank: int, config: AttentionParityConfig) -> dict:
    mesh = build_mesh(dp=1, cp=config.cp, device_type="cpu")
    table = {}
    for mode in config.modes:
        for index, name in enumerate(config.scenarios):
            table[f"{mode}/{name}"] = compare_attention(
                SCENARIOS[name],
                mode=mode,
                cp_size=config.cp,
                cp_rank=mesh.cp_rank,
                group=mesh.cp_group,
                dtype=getattr(torch, config.dtype),
                seed=config.seed + 1000 * index,
                shape=config.shape,
            )
    return table


def _gather_under_torchrun(config: AttentionParityConfig) -> list[dict] | None:
    """Under torchrun (RANK set): run this rank, gather every table on rank 0 (None elsewhere)."""
    rank = init_from_env(backend="gloo")
    try:
        table = _rank_main(rank, config)
        tables = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(table, tables, dst=0)
        return tables
    finally:
        dist.destroy_process_group()


def run_attention_parity(config: AttentionParityConfig) -> bool:
    """Print the max error over ranks per mode and scenario; True when all pass.

    Spawns ``config.cp`` local gloo ranks, or, when launched by torchrun (``RANK`` in the
    environment, world size = cp), runs this process's rank and reports on rank 0.
    """
    if config.dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {config.dtype!r}")
    if "RANK" in os.environ:
        tables = _gather_under_torchrun(config)
        if tables is None:
            return True
    else:
        tables = spawn(_rank_main, config.cp, config)
    limit = TOLERANCE[config.dtype]
    print(f"attention parity: CP={config.cp} dtype={config.dtype} vs float64 single-process reference")
    print(f"config: {json.dumps(dataclasses.asdict(config))}")
    header = f"{'mode/scenario':28s}" + "".join(f"{f:>11s}" for f in FIELDS) + "  pads  result"
    print(header)
    ok_all = True
    for key in tables[0]:
        worst = {f: max(t[key][f] for t in tables) for f in FIELDS}
        pads = all(t[key]["stream_pad_zero"] and t[key]["finite"] for t in tables)
        ok = pads and all(value <= limit for value in worst.values())
        ok_all &= ok
        print(
            f"{key:28s}"
            + "".join(f"{worst[f]:11.2e}" for f in FIELDS)
            + f"  {'ok' if pads else 'BAD'}"
            + f"   {'PASS' if ok else 'FAIL'}"
        )
    print(
        f"limit {limit:.0e} ({'absolute' if config.dtype == 'float64' else 'relative'}): "
        f"{'all PASS' if ok_all else 'FAILURES above'}"
    )
    return ok_all
