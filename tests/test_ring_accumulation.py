"""The ring-accumulation probe (:mod:`ringtune.probes.ring_accumulation`) on real gloo ranks.

Honest ring attention in bfloat16 sums bf16 block results in float32 and rounds once: at CP 1, 2 and 4 its
dQ/dK/dV equal the same blocks summed in float64 and rounded once, element for element (0 mismatches). The
``ring_dkv_exchange_bf16`` fault (partial dK/dV rounded to bf16 before each hop) moves ~22% of dK/dV at CP=4,
far above :data:`MISMATCH_LIMIT`; at CP=2 each hop carries one block's bf16 values, so it is exact there.
float32 is its own accumulator: the probe does not apply.
"""

from __future__ import annotations

import pytest
import torch

from ringtune.parallel.launch import spawn
from ringtune.parallel.mesh import build_mesh
from ringtune.probes.ring_accumulation import MISMATCH_LIMIT, mismatch_fraction, ring_accumulation_counts


def _rank(rank: int, cp: int, fault: str | None) -> dict | None:
    mesh = build_mesh(dp=1, cp=cp, device_type="cpu")
    return ring_accumulation_counts(
        mesh.cp_group,
        cp_size=cp,
        cp_rank=mesh.cp_rank,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        fault=fault,
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_honest_ring_rounds_once_and_the_bf16_hop_fault_does_not(cp):
    honest = mismatch_fraction(spawn(_rank, cp, cp, None))
    assert honest == {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    faulty = mismatch_fraction(spawn(_rank, cp, cp, "ring_dkv_exchange_bf16"))
    assert faulty is not None and faulty["dq"] == 0.0  # dQ never travels
    if cp == 2:
        assert faulty == honest  # one block per hop: rounding a bf16 value to bf16 is exact
    else:
        assert min(faulty["dk"], faulty["dv"]) > 10 * MISMATCH_LIMIT, faulty


def test_cp1_counts_and_float32_does_not_apply():
    counts = ring_accumulation_counts(None, cp_size=1, cp_rank=0, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert counts is not None and all(bad == 0 and total > 10_000 for bad, total in counts.values())
    assert mismatch_fraction([counts]) == {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    assert ring_accumulation_counts(None, cp_size=1, cp_rank=0, dtype=torch.float32, device=torch.device("cpu")) is None
    assert mismatch_fraction([None, None]) is None
