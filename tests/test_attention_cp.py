"""CP attention (zigzag ring, all-gather K/V, all-to-all) against the single-process reference.

One pool of 4 gloo ranks serves every case; a case builds the DP×CP mesh it needs (CP 1, 2, 4 with
DP filling the rest, each DP group on its own seed) and checks every scenario of the catalogue
(1-17-token rows, lengths not divisible by 2C, sequences longer than a chunk, a pad-only row).
"""

from __future__ import annotations

import pytest
import torch

from ringtune.errors import ParallelConfigError
from ringtune.layout import zigzag_plan
from ringtune.ops.attention import cp_attention_fn
from ringtune.probes.attention_parity import FIELDS, AttentionShape, compare_attention
from ringtune.probes.scenarios import SCENARIOS

MODES = ["ring", "allgather", "alltoall"]


def attention_case(ctx, *, mode: str, cp: int, dtype: str, shape: AttentionShape | None = None):
    """On every rank: each scenario through ``mode`` at CP=cp vs the reference; errors per scenario."""
    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    return {
        name: compare_attention(
            seq_lens,
            mode=mode,
            cp_size=cp,
            cp_rank=mesh.cp_rank,
            group=mesh.cp_group,
            dtype=getattr(torch, dtype),
            seed=1000 * index + mesh.dp_rank,
            shape=shape or AttentionShape(),
        )
        for index, (name, seq_lens) in enumerate(SCENARIOS.items())
    }


def check(results_per_rank, tol: float) -> None:
    for rank, results in enumerate(results_per_rank):
        for name, row in results.items():
            assert row["finite"], (rank, name, row)
            assert row["stream_pad_zero"], (rank, name, row)
            bad = {key: row[key] for key in FIELDS if not row[key] <= tol}
            assert not bad, f"rank {rank} scenario {name}: {bad} > {tol}"


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_float64_equals_reference(pool4, mode, cp):
    check(pool4.run(attention_case, mode=mode, cp=cp, dtype="float64"), tol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_float64_custom_scale_and_sharp_logits(pool4, mode):
    shape = AttentionShape(scale=0.7, sharpness=3.0)
    check(pool4.run(attention_case, mode=mode, cp=4, dtype="float64", shape=shape), tol=1e-10)


# float32: the kernels accumulate in fp32 and the merge is fp32, so errors are a few ulps of the
# softmax-weighted sums over at most ~350 keys: ~1e-6 relative; 2e-5 leaves margin without hiding
# a wrong block (a wrong mask or a missed block moves outputs by O(1e-1), see the negative control).
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_float32_close_to_reference(pool4, mode, cp):
    check(pool4.run(attention_case, mode=mode, cp=cp, dtype="float32"), tol=2e-5)


# bfloat16: inputs are the same bf16 values on both sides; the kernel rounds probabilities and
# outputs to bf16 (8 bits of mantissa: 2^-8 ≈ 0.4% per rounding) and gradients pass through a few
# such roundings, so 3% of the largest magnitude; a wrong block is still O(10%) off.
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_close_to_reference(pool4, mode, cp):
    check(pool4.run(attention_case, mode=mode, cp=cp, dtype="bfloat16"), tol=3e-2)


def misaligned_case(ctx, *, mode: str):
    """Negative control: the op is told a layout of the same size whose sequence boundaries differ."""
    mesh = ctx.mesh(dp=1, cp=4)
    return compare_attention(
        (5, 333, 1, 17, 40),
        mode=mode,
        cp_size=4,
        cp_rank=mesh.cp_rank,
        group=mesh.cp_group,
        dtype=torch.float64,
        seed=7,
        shape=AttentionShape(),
        layout_seq_lens=(40, 17, 1, 333, 5),
    )


@pytest.mark.parametrize("mode", MODES)
def test_negative_control_misaligned_layout_is_caught(pool4, mode):
    rows = pool4.run(misaligned_case, mode=mode)
    assert max(row["out"] for row in rows) > 1e-2
    assert max(row["dk"] for row in rows) > 1e-2


def ulysses_bad_heads_case(ctx):
    mesh = ctx.mesh(dp=1, cp=4)
    plan = zigzag_plan((5, 3), cp_size=4, cp_rank=mesh.cp_rank, pad_multiplier=8)
    q = torch.zeros(plan.local_len, 8, 4)
    kv = torch.zeros(plan.local_len, 2, 4)
    try:
        cp_attention_fn("alltoall")(q, kv, kv, plan, mesh.cp_group)
    except ParallelConfigError as exc:
        return str(exc)
    return None


def test_alltoall_rejects_heads_not_divisible(pool4):
    for message in pool4.run(ulysses_bad_heads_case):
        assert message is not None and "kv heads" in message and "2 % 4" in message


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="attention='zigzag': choose one of ring, allgather, alltoall"):
        cp_attention_fn("zigzag")
