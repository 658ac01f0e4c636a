"""ringtune.debug_faults: NO_FAULTS is the identity everywhere; each fault acts in its hook only, on its ranks."""

from __future__ import annotations

import pytest
import torch

from ringtune.debug_faults import ALL_FAULTS, DEBUG_FAULTS, NO_FAULTS, FaultHooks, check_fault, fault_hooks
from ringtune.layout import zigzag_plan
from ringtune.models.shard import shard_of


def test_no_faults_is_the_identity_and_the_default_of_a_shard():
    x = torch.randn(5, 3, dtype=torch.float64)
    positions = torch.arange(8)
    assert NO_FAULTS.shift_positions(positions) is positions
    assert NO_FAULTS.dkv_exchange(x, torch.bfloat16) is x
    assert NO_FAULTS.decay_relayout(x, torch.bfloat16) is x
    assert NO_FAULTS.handed_state(x) is x
    assert NO_FAULTS.flip_loss_sign(x) is x
    mask = torch.ones(3, dtype=torch.bool)
    assert NO_FAULTS.halo_mask(mask) is mask
    assert [NO_FAULTS.ring_source(2, step, 4) for step in range(4)] == [2, 1, 0, 3]
    assert NO_FAULTS.unscored_grads([], torch.full((4,), -100), {}) is None
    grads = [x.clone()]
    NO_FAULTS.scale_reduced_gradients(grads, 4)
    assert torch.equal(grads[0], x)
    assert shard_of((5, 3)).faults is NO_FAULTS
    assert fault_hooks(None, cp_size=4, cp_rank=3) is NO_FAULTS
    NO_FAULTS.microbatch_started(0)  # no failure injected


def test_before_microbatch_is_called_with_each_index():
    seen = []
    FaultHooks(before_microbatch=seen.append).microbatch_started(3)
    assert seen == [3]


def test_unknown_fault_names_are_refused_with_the_choices():
    assert check_fault(None) is None and set(DEBUG_FAULTS) < set(ALL_FAULTS)
    with pytest.raises(ValueError, match="unknown; choose one of"):
        check_fault("gradients_halved")
    with pytest.raises(ValueError, match="gradients_halved"):
        FaultHooks(name="gradients_halved")


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_position_off_by_one_shifts_chunk_c_on_the_last_rank_only(cp_rank):
    plan = zigzag_plan((10, 7, 1), cp_size=2, cp_rank=cp_rank, pad_multiplier=8)
    got = fault_hooks("position_off_by_one", cp_size=2, cp_rank=cp_rank, plan=plan).shift_positions(plan.positions)
    want = plan.positions.clone()
    if cp_rank == 1:  # rank C-1 = 1 holds chunks 1 and 2 of each sequence: chunk C = 2 is its second half
        for start, c in zip(plan.local_starts, plan.chunk_lens, strict=True):
            want[start + c : start + 2 * c] += 1
        assert not torch.equal(got, plan.positions)
    assert torch.equal(got, want)
    short = torch.arange(2)  # not the row's stream (a decode step): unchanged
    assert fault_hooks("position_off_by_one", cp_size=2, cp_rank=1, plan=plan).shift_positions(short) is short


def test_the_op_hooks_act_only_under_their_fault():
    x = torch.tensor([1.0 + 2**-12, 3.0], dtype=torch.float32)  # 1 + 2^-12 rounds to 1 in bfloat16
    rounded = torch.tensor([1.0, 3.0])
    assert torch.equal(FaultHooks(name="ring_dkv_exchange_bf16").dkv_exchange(x, torch.bfloat16), rounded)
    assert FaultHooks(name="ring_dkv_exchange_bf16").decay_relayout(x, torch.bfloat16) is x
    assert torch.equal(FaultHooks(name="gdn_decay_relayout_bf16").decay_relayout(x, torch.bfloat16), rounded)
    reversed_ring = FaultHooks(name="ring_shift_reversed")
    assert [reversed_ring.ring_source(2, step, 4) for step in range(4)] == [2, 3, 0, 1]
    assert [reversed_ring.ring_source(1, step, 2) for step in range(2)] == [1, 0]  # a ring of two: the same
    state = torch.ones(2, 3, 4)
    assert torch.equal(FaultHooks(name="gdn_state_dropped").handed_state(state), torch.zeros(2, 3, 4))
    assert FaultHooks(name="gdn_halo_dropped").handed_state(state) is state
    mask = torch.ones(3, dtype=torch.bool)
    assert not FaultHooks(name="gdn_halo_dropped").halo_mask(mask).any()


def test_the_engine_hooks_act_on_their_ranks():
    terms = torch.tensor([1.0, -2.0])
    assert torch.equal(FaultHooks(name="loss_sign_flipped", cp_size=4, cp_rank=3).flip_loss_sign(terms), -terms)
    assert FaultHooks(name="loss_sign_flipped", cp_size=4, cp_rank=2).flip_loss_sign(terms) is terms
    grads = [torch.full((2,), 8.0)]
    FaultHooks(name="gradients_averaged").scale_reduced_gradients(grads, 4)
    assert torch.equal(grads[0], torch.full((2,), 2.0))
    for cp_rank, want in ((0, 0.1), (1, 0.0)):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], weight_decay=0.1)
        FaultHooks(name="weight_decay_skipped_cp1", cp_size=2, cp_rank=cp_rank).skip_weight_decay(optimizer)
        assert optimizer.param_groups[0]["weight_decay"] == want


def test_unscored_backward_skipped_puts_back_the_gradients_of_an_unscored_share():
    hooks = FaultHooks(name="unscored_backward_skipped")
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    assert hooks.unscored_grads([p], torch.tensor([3, -100]), {}) is None  # a scored token: nothing saved
    saved = hooks.unscored_grads([p], torch.tensor([3, -100]), {"weights": torch.tensor([0.0, 1.0])})
    p.grad = torch.full((2,), 5.0)  # this share's backward
    FaultHooks.skip_unscored_backward([p], saved)
    assert torch.equal(p.grad, torch.ones(2))


# ------------------------------------------------------------------ the faults of the serve options (issue 34)


def test_allgather_kv_rank_reversed_flips_the_rank_blocks():
    kv = torch.arange(12.0).reshape(6, 2)  # C=3 ranks of 2 tokens, rank-major
    got = FaultHooks(name="allgather_kv_rank_reversed").gathered_kv(kv, 3)
    assert torch.equal(got, torch.cat([kv[4:6], kv[2:4], kv[0:2]]))
    assert NO_FAULTS.gathered_kv(kv, 3) is kv
    assert FaultHooks(name="ring_shift_reversed").gathered_kv(kv, 3) is kv


def test_recompute_rerun_shifted_moves_only_the_rerun():
    hooks = FaultHooks(name="recompute_rerun_shifted")
    positions = torch.arange(5)
    assert hooks.rerun_positions(positions, rerun=False) is positions  # the forward: right
    assert torch.equal(hooks.rerun_positions(positions, rerun=True), positions + 1)  # the backward's rerun
    assert NO_FAULTS.rerun_positions(positions, rerun=True) is positions


def test_mixed_cast_detached_on_the_last_cp_rank_only():
    assert FaultHooks(name="mixed_cast_detached_last_cp", cp_size=2, cp_rank=1).detach_mixed_casts()
    assert not FaultHooks(name="mixed_cast_detached_last_cp", cp_size=2, cp_rank=0).detach_mixed_casts()
    assert not FaultHooks(name="mixed_cast_detached_last_cp", cp_size=1, cp_rank=0).detach_mixed_casts()
    assert not NO_FAULTS.detach_mixed_casts()


def test_sharded_step_count_cp1_advances_cp_rank_1_under_fsdp_only():
    for cp_rank, sharding, want in ((1, "dp_cp", 2.0), (1, "dp", 2.0), (0, "dp_cp", 1.0), (1, "none", 1.0)):
        p = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([p])
        p.grad = torch.ones(2)
        optimizer.step()  # step 1: the state exists now
        FaultHooks(name="sharded_step_count_cp1", cp_size=2, cp_rank=cp_rank).skip_weight_decay(optimizer, sharding)
        assert float(optimizer.state[p]["step"]) == want, (cp_rank, sharding)


def test_lora_grads_doubled_on_the_last_cp_rank_of_a_lora_run_only():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    hooks = FaultHooks(name="lora_grads_doubled_last_cp", cp_size=2, cp_rank=1)
    assert hooks.adapter_grads([p], lora=False) is None  # full fine-tuning: untouched
    assert FaultHooks(name="lora_grads_doubled_last_cp", cp_size=2, cp_rank=0).adapter_grads([p], lora=True) is None
    saved = hooks.adapter_grads([p], lora=True)
    p.grad = torch.full((2,), 4.0)  # this microbatch added 3
    FaultHooks.double_adapter_grads([p], saved)
    assert torch.equal(p.grad, torch.full((2,), 7.0))


def test_long_row_positions_carried_acts_past_32_datums_only():
    few = zigzag_plan((5,) * 32, cp_size=2, cp_rank=0, pad_multiplier=8)
    few_hooks = fault_hooks("long_row_positions_carried", cp_size=2, cp_rank=0, plan=few)
    assert few_hooks.shift_positions(few.positions) is few.positions
    many = zigzag_plan((5,) * 40, cp_size=2, cp_rank=1, pad_multiplier=8)
    many_hooks = fault_hooks("long_row_positions_carried", cp_size=2, cp_rank=1, plan=many)
    got = many_hooks.shift_positions(many.positions)
    moved = got != many.positions
    assert not moved[: many.local_starts[32]].any() and moved.sum() == sum(many.chunk_lens[32:])
    for start, c in zip(many.local_starts[32:], many.chunk_lens[32:], strict=True):
        assert moved[start + c : start + 2 * c].all()  # the rank's second chunk of the datum: relative positions move
