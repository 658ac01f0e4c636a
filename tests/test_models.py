"""Decoders against transformers 5.24 on random checkpoints, HF save/load both ways, and CP errors.

transformers computes its RMSNorms, rotary tables, GDN gates and GDN recurrence in float32 whatever the
model dtype, so a float64 transformers model is a float32-accurate one. Our modules follow the same
rounding steps in float32 (and keep float64 in float64), so the comparison runs in float32: per-token
log-probs of O(5) magnitude after 4 layers agree to ~1e-6 (measured), tolerance 1e-4; gradients to
~1e-6 relative, tolerance 1e-4 relative.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.tiny_models import LENGTHS, hf_model, next_token_labels, packed_tokens

from ringtune.errors import ParallelConfigError, UserInputError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf, save_hf
from ringtune.models.shard import PackedShard, shard_of

transformers = pytest.importorskip("transformers")


def hf_label_logprobs(hf, ids: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
    """transformers' log p(next token) per token, one sequence per batch row; last token of each gets 0."""
    outs, start = [], 0
    for n in lens:
        seq = ids[start : start + n]
        logits = hf(input_ids=seq[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, seq[1:, None])[:, 0]
        outs.append(torch.cat([lp, lp.new_zeros(1)]))
        start += n
    return torch.cat(outs)


def our_label_logprobs(model, ids: torch.Tensor, lens: tuple[int, ...], shard: PackedShard | None = None):
    shard = shard or shard_of(lens)
    labels = next_token_labels(ids, lens)
    local_ids = zigzag_slice(ids, shard.plan)
    local_labels = zigzag_slice(labels, shard.plan, pad_value=-100)
    return model.label_logprobs(local_ids, local_labels, shard), shard


@pytest.mark.parametrize("family", ["qwen3_5", "llama", "qwen3"])
def test_logprobs_and_grads_equal_transformers(tmp_path, family):
    hf = hf_model(family, seed=1).float()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf", dtype=torch.float32)
    ids = packed_tokens(LENGTHS, hf.config.vocab_size, seed=2)
    want = hf_label_logprobs(hf, ids, LENGTHS)
    got, shard = our_label_logprobs(ours, ids, LENGTHS)
    want_local = zigzag_slice(want, shard.plan)
    real = shard.plan.is_real
    assert (got[real] - want_local[real]).abs().max() < 1e-4
    want.sum().backward()
    got.sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref = hf_params[name].grad
        assert ref is not None, name
        err = float((p.grad - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)
        assert err < 1e-4, (name, err)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_save_then_transformers_load(tmp_path, family):
    hf = hf_model(family, seed=3).float()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "ours", max_shard_bytes=20_000)  # small shards: exercises the index
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, attn_implementation="eager"
    )
    ids = packed_tokens((9,), hf.config.vocab_size, seed=4)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids[None]).logits, hf(input_ids=ids[None]).logits)
        again = load_hf(tmp_path / "ours")
        shard = shard_of((9,))
        local = zigzag_slice(ids, shard.plan)  # 10 tokens: the row is padded to a multiple of 2·CP
        assert torch.equal(again.logits(local, shard), ours.logits(local, shard))


def test_save_replaces_atomically(tmp_path):
    hf = hf_model("llama", seed=5).float()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "ckpt")
    save_hf(ours, tmp_path / "ckpt")  # over an existing checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no temporaries left behind
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["model_type"] == "llama"


def test_bad_checkpoints_name_the_problem(tmp_path):
    hf = hf_model("llama", seed=6).float()
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserInputError, match="missing tensors"):
        load_hf(tmp_path / "hf")
    with pytest.raises(UserInputError, match=r"config\.json not found"):
        load_hf(tmp_path / "nowhere")


def test_cp_refuses_heads_and_missing_positions(tmp_path):
    hf = hf_model("qwen3_5", seed=7).float()
    hf.save_pretrained(tmp_path / "hf")
    config = load_hf(tmp_path / "hf").config
    with pytest.raises(ParallelConfigError, match=r"linear_num_key_heads=4 divisible by TP·CP=8"):
        config.check_parallel(cp_size=8, attention="ring", gated_delta="headwise")
    with pytest.raises(ParallelConfigError, match=r"num_key_value_heads=2 divisible by TP·CP=4"):
        config.check_parallel(cp_size=4, attention="alltoall", gated_delta="chunkwise")
    config.check_parallel(cp_size=4, attention="ring", gated_delta="chunkwise")
    plan = shard_of((5, 3)).plan
    with pytest.raises(ParallelConfigError, match="positions must be the rank-local positions"):
        PackedShard(plan=plan, positions=None)
