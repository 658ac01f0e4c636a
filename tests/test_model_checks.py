"""Model-side runtime checks: shard positions against the plan, rotary dims, the CP mode registry, and the
embedding's padding row (no gradient from the lookup, as in transformers)."""

from __future__ import annotations

import json

import pytest
import torch
from support.tiny_models import hf_model, next_token_labels

from ringtune.errors import ParallelConfigError, UserInputError
from ringtune.layout import zigzag_plan
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.config import DecoderConfig
from ringtune.models.shard import PackedShard, shard_of
from ringtune.ops.attention import CP_ATTENTION, cp_attention_fn
from ringtune.ops.cp_modes import (
    ALL_GATED_DELTA_MODES,
    ATTENTION_MODES,
    GATED_DELTA_MODES,
    check_attention_mode,
    check_gated_delta_mode,
)
from ringtune.ops.gated_delta.cp import GDN_CP, gdn_cp_fn

transformers = pytest.importorskip("transformers")


def test_shard_positions_must_be_the_plans():
    plan = zigzag_plan((5, 7), cp_size=1, cp_rank=0)
    PackedShard(plan=plan, positions=plan.positions)  # the plan's own: fine
    wrong = torch.arange(plan.local_len)  # restarts nowhere; the second sequence starts at local token 6 (5 -> 2·CP)
    with pytest.raises(ParallelConfigError, match=r"positions\[6\]=6 but the plan puts that local token at position 0"):
        PackedShard(plan=plan, positions=wrong)


@pytest.mark.parametrize(("head_dim", "factor", "family"), [(7, 1.0, "llama"), (6, 0.25, "qwen3_5_text")])
def test_odd_rotary_dim_is_a_user_error_with_the_numbers(head_dim, factor, family):
    hf = {
        "model_type": family,
        "vocab_size": 32,
        "hidden_size": 2 * head_dim,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": head_dim,
        "partial_rotary_factor": factor,
        "layer_types": ["full_attention"],
    }
    with pytest.raises(UserInputError, match=rf"rotary dim = head_dim·partial_rotary_factor = {head_dim}·{factor}"):
        DecoderConfig.from_hf(hf)


def test_mode_registry_is_the_one_source():
    assert tuple(CP_ATTENTION) == ATTENTION_MODES and tuple(GDN_CP) == ALL_GATED_DELTA_MODES
    for mode in ATTENTION_MODES:
        assert cp_attention_fn(mode) is CP_ATTENTION[mode]
    for mode in GATED_DELTA_MODES:  # fla_cp (CUDA + fla only) is refused here: tests/test_gated_delta_cp.py
        assert gdn_cp_fn(mode) is GDN_CP[mode]
    with pytest.raises(ParallelConfigError, match="attention='ringg': choose one of ring, allgather, alltoall"):
        check_attention_mode("ringg")
    with pytest.raises(ParallelConfigError, match="gated_delta='rowwise'"):
        check_gated_delta_mode("rowwise")
    with pytest.raises(ParallelConfigError, match="gated_delta='x'"):
        shard_of((4,), gated_delta="x")


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_pad_token_row_gets_no_lookup_gradient_as_in_transformers(tmp_path, family):
    hf = hf_model(family, seed=3).float()
    pad = 5
    hf.config.pad_token_id = pad
    hf.model.embed_tokens.padding_idx = pad
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("pad_token_id", config.get("text_config", {}).get("pad_token_id")) == pad
    ours = load_hf(tmp_path, dtype=torch.float32)
    assert ours.model.embed_tokens.padding_idx == pad
    ids = torch.tensor([1, pad, 7, pad, 3, 9, 2, 4])
    labels = next_token_labels(ids, (8,))
    shard = shard_of((8,))
    ours.label_logprobs(ids, labels, shard).sum().backward()
    logits = hf(input_ids=ids[None]).logits[0]
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, ids[1:, None]).sum()
    lp.backward()
    got = ours.model.embed_tokens.weight.grad
    want = hf.model.embed_tokens.weight.grad
    # The lookup gives the pad row nothing; untied, that row's gradient is exactly 0 on both sides (tied, the
    # head's gradient still reaches it, in both).
    if ours.lm_head is not None:
        assert torch.count_nonzero(got[pad]) == 0 and torch.count_nonzero(want[pad]) == 0
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
