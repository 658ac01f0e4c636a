"""``ringtune attention-parity``: run the attention parity probe on spawned gloo ranks and print a table."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from ringtune.dist.launch import spawn
from ringtune.dist.mesh import build_mesh
from ringtune.probes.attention_parity import FIELDS, AttentionShape, compare_attention
from ringtune.testing.scenarios import SCENARIOS

# Limits the probe enforces per dtype (same reasoning as tests/test_attention_cp.py).
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2}


@dataclass(frozen=True, kw_only=True)
class AttentionParityConfig:
    """What ``ringtune attention-parity`` runs; one field per command-line flag."""

    cp: int = 2
    modes: tuple[str, ...] = ("ring", "allgather", "alltoall")
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


def run_attention_parity(config: AttentionParityConfig) -> bool:
    """Spawn ``config.cp`` ranks, print the max error over ranks per mode and scenario; True when all pass."""
    if config.dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {config.dtype!r}")
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
