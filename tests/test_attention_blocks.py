"""Single-process pieces of attention: block kernels, the block driver and the block schedules."""

from __future__ import annotations

import pytest
import torch

from ringtune.layout import zigzag_plan
from ringtune.ops.attention import reference_varlen_attention, varlen_block_attention
from ringtune.ops.attention.kernels import KERNELS, select_block_kernel
from ringtune.ops.attention.packed_blocks import varlen_groups
from ringtune.ops.attention.schedule import BlockPair, causal_pairs, contiguous_split_work, ring_step_pairs, ring_work


def _row(seq_lens, seed=0, hq=4, hkv=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    q, k, v = (torch.randn(T, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    return q, k, v, cu


@pytest.mark.parametrize("kernel", ["cpu_flash", "math", "cpu_varlen_loop"])
def test_block_kernels_equal_reference_float64(kernel):
    q, k, v, cu = _row((1, 7, 64, 130, 3))
    dout = torch.randn_like(q)
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_block_attention(*a, causal_pairs(cu), kernel=kernel, scale=0.4)
    ref, ref_lse = reference_varlen_attention(*b, cu, scale=0.4)
    (out * dout).sum().backward()
    (ref * dout).sum().backward()
    assert (out - ref).abs().max() < 1e-12
    assert (lse - ref_lse).abs().max() < 1e-12
    for x, y in zip(a, b, strict=True):
        assert (x.grad - y.grad).abs().max() < 1e-12


def test_kernel_choice_is_made_in_one_place():
    assert select_block_kernel(torch.device("cpu"), torch.bfloat16).name == "cpu_flash"
    assert select_block_kernel(torch.device("cpu"), torch.float32, "math").name == "math"
    assert set(KERNELS) == {"cpu_flash", "math", "cuda_flash", "cuda_varlen", "cpu_varlen_loop"}
    with pytest.raises(ValueError, match="unknown attention block kernel 'flash3'"):
        select_block_kernel(torch.device("cpu"), torch.float32, "flash3")
    # a CUDA kernel asked for on CPU (or for a dtype it lacks) is refused with what it needs
    with pytest.raises(ValueError, match=r"'cuda_varlen' takes cuda tensors of .*bfloat16.*; got cpu torch.float32"):
        select_block_kernel(torch.device("cpu"), torch.float32, "cuda_varlen")
    with pytest.raises(ValueError, match="'cpu_varlen_loop' takes cpu"):
        select_block_kernel(torch.device("cuda"), torch.bfloat16, "cpu_varlen_loop")


def test_varlen_groups_pack_overlapping_blocks_and_merge_them():
    """Blocks sharing query rows (a full and a causal block per chunk, as the all-gather schedule makes) go into
    separate varlen calls and merge by log-sum-exp: the packed kernel equals the reference (float64, ~1e-12)."""
    q, k, v, _ = _row((8, 1, 5), seed=3)
    pairs = [
        BlockPair(0, 4, 0, 4, True),
        BlockPair(4, 8, 0, 4, False),
        BlockPair(4, 8, 4, 8, True),
        BlockPair(8, 9, 8, 9, True),
        BlockPair(9, 14, 9, 14, True),
    ]
    groups = varlen_groups(pairs)
    assert [[p.q_start for p in g] for g in groups] == [[0, 4, 8, 9], [4]]
    dout = torch.randn_like(q)
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_block_attention(*a, pairs, kernel="cpu_varlen_loop")
    ref, ref_lse = reference_varlen_attention(*b, torch.tensor([0, 8, 9, 14]))
    (out * dout).sum().backward()
    (ref * dout).sum().backward()
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    for x, y in zip(a, b, strict=True):
        assert (x.grad - y.grad).abs().max() < 1e-12


def test_uncovered_rows_are_zero_with_minus_inf_lse():
    q, k, v, _ = _row((6,))
    out, lse = varlen_block_attention(q, k, v, causal_pairs([0, 4]))
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    assert torch.isinf(lse[4:]).all() and (lse[4:] < 0).all()


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_ring_work_is_equal_on_every_rank(cp):
    seq_lens = (1, 17, 300, 5, 64, 2000)
    work = [ring_work(zigzag_plan(seq_lens, cp_size=cp, cp_rank=r)) for r in range(cp)]
    assert len(set(work)) == 1
    # The ring covers exactly the causal triangle of every padded sequence once.
    padded = [2 * cp * zigzag_plan((n,), cp_size=cp, cp_rank=0).chunk_lens[0] for n in seq_lens]
    assert sum(work) == sum(n * (n + 1) // 2 for n in padded)
    contiguous = contiguous_split_work(seq_lens, cp)
    assert sum(contiguous) == sum(n * (n + 1) // 2 for n in seq_lens)


def test_ring_step_blocks_are_diagonal_full_or_skipped():
    plan = zigzag_plan((16,), cp_size=4, cp_rank=1)
    c = plan.chunk_lens[0]
    assert ring_step_pairs(plan, 1)[0].causal and ring_step_pairs(plan, 1)[0].work == 2 * c * (2 * c + 1) // 2
    before, after = ring_step_pairs(plan, 0)[0], ring_step_pairs(plan, 3)[0]
    assert (before.q_end - before.q_start, before.k_end - before.k_start, before.causal) == (2 * c, c, False)
    assert (after.q_end - after.q_start, after.k_end - after.k_start, after.causal) == (c, 2 * c, False)
