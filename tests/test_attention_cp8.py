"""Smoke test at CP=8 (8 gloo ranks): every attention variant equals the reference in float64."""

from __future__ import annotations

import pytest
import torch

from ringtune.probes.attention_parity import FIELDS, AttentionShape, compare_attention
from ringtune.probes.scenarios import SCENARIOS


def cp8_case(ctx, *, mode: str):
    mesh = ctx.mesh(dp=1, cp=8)
    return {
        name: compare_attention(
            SCENARIOS[name],
            mode=mode,
            cp_size=8,
            cp_rank=mesh.cp_rank,
            group=mesh.cp_group,
            dtype=torch.float64,
            seed=11,
            shape=AttentionShape(heads=8, kv_heads=8, head_dim=8),
        )
        for name in ("tiny_mix", "long_mixed", "pad_only")
    }


@pytest.mark.parametrize("mode", ["ring", "allgather", "alltoall"])
def test_cp8_float64_equals_reference(pool8, mode):
    for rank, results in enumerate(pool8.run(cp8_case, mode=mode)):
        for name, row in results.items():
            assert row["finite"] and row["stream_pad_zero"], (rank, name, row)
            assert all(row[f] <= 1e-10 for f in FIELDS), (rank, name, row)
