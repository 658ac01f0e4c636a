"""Activation recomputation (``ringtune.models.recompute``): same numbers as ``none``, at CP 1, 2 and 4, every mode.

Float64 log-probs and parameter gradients (summed over the CP group) of ``full`` and ``selective`` must equal
those of ``none`` within 1e-12, for every CP attention mode the tiny model allows (all-to-all needs its 4 heads /
2 KV heads divisible by CP: CP 2 only) and both GatedDeltaNet modes, on packed rows of many datums. A hang would
mean a recomputed layer ran its collectives in another order on some rank (the rank pool fails the case).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from support.tiny_models import LENGTHS, hf_model, next_token_labels, packed_tokens

from ringtune.errors import UserInputError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.decoder import CausalLM
from ringtune.models.recompute import RECOMPUTE_MODES, check_recompute_mode, set_recompute
from ringtune.models.shard import shard_of
from ringtune.ops.cp_modes import ATTENTION_MODES, GATED_DELTA_MODES

ROWS = {"many_datums": LENGTHS, "mixed": (2, 3, 17, 30)}
LIMIT = 1e-12


def _run(model: CausalLM, ids, labels, weights, shard, mode: str):
    set_recompute(model, mode)
    local = model.label_logprobs(zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)
    (local * zigzag_slice(weights, shard.plan)).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return local.detach(), grads


def recompute_case(ctx, *, family: str, cp: int, root: str) -> dict:
    """Max |recomputed - none| of log-probs and CP-summed gradients per (attention, GDN mode, recompute mode, row)."""
    import torch.distributed as dist

    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    model = load_hf(pathlib.Path(root) / family, dtype=torch.float64)
    heads, kv_heads = model.config.num_heads, model.config.num_kv_heads
    attentions = [a for a in ATTENTION_MODES if a != "alltoall" or (heads % cp == 0 and kv_heads % cp == 0)]
    gdn_modes = GATED_DELTA_MODES if family == "qwen3_5" else GATED_DELTA_MODES[:1]
    errors = {}
    for attention in attentions if cp > 1 else ["ring"]:
        for gated_delta in gdn_modes if cp > 1 else GATED_DELTA_MODES[:1]:
            for index, (name, lens) in enumerate(ROWS.items()):
                ids = packed_tokens(lens, model.config.vocab_size, seed=index)
                labels = next_token_labels(ids, lens)
                gen = torch.Generator().manual_seed(50 + index)
                weights = torch.randn(len(ids), generator=gen, dtype=torch.float64)
                shard = shard_of(
                    lens,
                    cp_size=cp,
                    cp_rank=mesh.cp_rank,
                    group=mesh.cp_group,
                    attention=attention,
                    gated_delta=gated_delta,
                    pad_multiplier=4,
                )
                runs = {mode: _run(model, ids, labels, weights, shard, mode) for mode in RECOMPUTE_MODES}
                for mode in RECOMPUTE_MODES[1:]:
                    lp_err = float((runs[mode][0] - runs["none"][0]).abs().max())
                    grad_err = 0.0
                    for n, g in runs[mode][1].items():
                        ref = runs["none"][1][n].clone()
                        dist.all_reduce(g, group=mesh.cp_group)
                        dist.all_reduce(ref, group=mesh.cp_group)
                        grad_err = max(grad_err, float((g - ref).abs().max()))
                    errors[(attention, gated_delta, mode, name)] = (lp_err, grad_err)
    set_recompute(model, "none")
    return errors


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("recompute_models")
    for family in ("qwen3_5", "llama"):
        hf_model(family, seed=11).save_pretrained(root / family)
    return root


@pytest.mark.parametrize(("family", "cp"), [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5", 4), ("llama", 2)])
def test_recompute_equals_none_float64(pool4, model_root, family, cp):
    per_rank = pool4.run(recompute_case, family=family, cp=cp, root=str(model_root))
    seen = set()
    for rank, errors in enumerate(per_rank):
        for key, (lp_err, grad_err) in errors.items():
            seen.add(key)
            assert lp_err <= LIMIT and grad_err <= LIMIT, (rank, key, lp_err, grad_err)
    expected = {1: {"ring"}, 2: {"ring", "allgather", "alltoall"}, 4: {"ring", "allgather"}}[cp]
    assert {key[0] for key in seen} == expected
    assert {key[2] for key in seen} == {"full", "selective"}


def test_recompute_reruns_the_right_parts(model_root):
    """full reruns every layer's mixer and MLP in backward; selective reruns GDN layers and MLPs, not attention."""
    model = load_hf(model_root / "qwen3_5", dtype=torch.float64)
    calls: dict[str, int] = {}

    def count(name: str):
        def hook(module, args, output):
            calls[name] = calls.get(name, 0) + 1

        return hook

    for i, layer in enumerate(model.model.layers):
        mixer = layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn
        mixer.register_forward_hook(count(f"{i}.{layer.layer_type}"))
        layer.mlp.register_forward_hook(count(f"{i}.mlp"))
    shard = shard_of(LENGTHS)
    ids = zigzag_slice(packed_tokens(LENGTHS, model.config.vocab_size, seed=0), shard.plan)
    labels = torch.where(ids > 0, ids, -100)
    per_mode = {}
    for mode in RECOMPUTE_MODES:
        calls.clear()
        set_recompute(model, mode)
        model.label_logprobs(ids, labels, shard).sum().backward()
        per_mode[mode] = dict(calls)
    types = [layer.layer_type for layer in model.model.layers]
    assert per_mode["none"] == {k: 1 for k in per_mode["none"]} and len(per_mode["none"]) == 2 * len(types)
    assert per_mode["full"] == {k: 2 for k in per_mode["none"]}
    for i, kind in enumerate(types):
        assert per_mode["selective"][f"{i}.mlp"] == 2
        # selective calls the attention's projections and core directly (the core runs once, kept).
        assert per_mode["selective"].get(f"{i}.{kind}", 0) == (2 if kind == "linear_attention" else 0)
    with torch.no_grad():  # no autograd: nothing to recompute, the plain forward runs once
        calls.clear()
        set_recompute(model, "full")
        model.label_logprobs(ids, labels, shard)
        assert set(calls.values()) == {1}


def test_bad_mode_names_the_field_and_choices(model_root):
    assert check_recompute_mode("selective") == "selective"
    for bad in ("partial", None, 1):
        with pytest.raises(UserInputError, match=r"recompute=.*choose one of none, full, selective"):
            check_recompute_mode(bad)
    model = load_hf(model_root / "llama", dtype=torch.float64)
    with pytest.raises(UserInputError, match="recompute='Full'"):
        set_recompute(model, "Full")


def test_trainer_option_sets_every_layer(model_root):
    from ringtune.engine.trainer import Trainer

    model = load_hf(model_root / "qwen3_5", dtype=torch.float64)
    Trainer(model, None, max_tokens_per_rank=64, recompute="selective")
    assert {layer.recompute for layer in model.model.layers} == {"selective"}
    with pytest.raises(UserInputError, match="recompute='some'"):
        Trainer(model, None, max_tokens_per_rank=64, recompute="some")
