"""Sparse MoE decoders (Qwen3-MoE, Qwen3.5-MoE) against transformers 5.24, checkpoints both ways, replay.

Tolerances as tests/test_models.py: float32, transformers' own float32 router softmax and expert loop;
per-token log-probs after 4 layers agree to ~5e-7 (measured), limit 1e-4; gradients to ~1e-5 relative
(measured), limit 1e-4 relative. The routers are randomised (tiny_models: std 0.5), so tokens pick different
experts (checked), and no top-k choice is near a tie at these sizes, so float32 rounding flips none.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.tiny_models import LENGTHS, hf_model, next_token_labels, packed_tokens

from ringtune.errors import UserInputError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf, save_hf
from ringtune.models.layers.moe import GROUPED_LINEAR, TopKRouter, moe_blocks
from ringtune.models.shard import shard_of

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "qwen3_5_moe")
# Every CP mode the tiny models fit at each size (2 kv heads: all-to-all at CP 2 only), as the dense tests.
MODES = {
    "qwen3_5_moe": [
        (1, "ring", "headwise"),
        (2, "ring", "headwise"),
        (2, "ring", "chunkwise"),
        (2, "allgather", "headwise"),
        (2, "alltoall", "chunkwise"),
        (4, "ring", "headwise"),
        (4, "ring", "chunkwise"),
        (4, "allgather", "chunkwise"),
    ],
    "qwen3_moe": [
        (1, "ring", "headwise"),
        (2, "ring", "headwise"),
        (2, "allgather", "headwise"),
        (2, "alltoall", "headwise"),
        (4, "ring", "headwise"),
        (4, "allgather", "headwise"),
    ],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("moe")
    for family in FAMILIES:
        hf_model(family, seed=1).float().save_pretrained(root / family)
    return root


def _hf_logprobs(hf, ids: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
    outs, start = [], 0
    for n in lens:
        seq = ids[start : start + n]
        lp = torch.log_softmax(hf(input_ids=seq[None]).logits[0].float(), -1)[:-1].gather(1, seq[1:, None])[:, 0]
        outs.append(torch.cat([lp, lp.new_zeros(1)]))
        start += n
    return torch.cat(outs)


def versus_transformers_case(ctx, *, family: str, root: str) -> dict[str, tuple[float, float]]:
    """On every rank: transformers' float32 log-probs and gradients, then ours at each (CP, modes) of MODES."""
    import torch.distributed as dist

    path = pathlib.Path(root) / family
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids = packed_tokens(LENGTHS, hf.config.vocab_size, seed=2)
    want = _hf_logprobs(hf, ids, LENGTHS)
    want.sum().backward()
    ref_grads = dict(hf.named_parameters())
    labels = next_token_labels(ids, LENGTHS)
    out = {}
    for cp, attention, gated_delta in MODES[family]:
        mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
        ours = load_hf(path, dtype=torch.float32)
        shard = shard_of(
            LENGTHS, cp_size=cp, cp_rank=mesh.cp_rank, group=mesh.cp_group, attention=attention, gated_delta=gated_delta
        )
        local_labels = zigzag_slice(labels, shard.plan, pad_value=-100)
        got = ours.label_logprobs(zigzag_slice(ids, shard.plan), local_labels, shard)
        got.sum().backward()
        real = shard.plan.is_real
        lp_err = float((got[real] - want[shard.plan.row_index[real]]).abs().max())
        grad_err = 0.0
        for name, p in ours.named_parameters():
            if cp > 1:
                dist.all_reduce(p.grad, group=mesh.cp_group)
            ref = ref_grads[name].grad
            grad_err = max(grad_err, float((p.grad - ref).abs().max()) / max(float(ref.abs().max()), 1e-6))
        out[f"CP{cp} {attention}/{gated_delta}"] = (lp_err, grad_err)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_and_grads_equal_transformers_at_cp_1_2_4(pool4, checkpoints, family):
    per_rank = pool4.run(versus_transformers_case, family=family, root=str(checkpoints))
    worst = {k: (max(r[k][0] for r in per_rank), max(r[k][1] for r in per_rank)) for k in per_rank[0]}
    print(f"\n{family} float32 vs transformers (max |d logprob|, max rel grad):")
    for key, (lp_err, grad_err) in worst.items():
        print(f"  {key}: {lp_err:.2e} {grad_err:.2e}")
    assert len(worst) == len(MODES[family])
    for key, (lp_err, grad_err) in worst.items():
        assert lp_err < 1e-4 and grad_err < 1e-4, (key, lp_err, grad_err)


def _routing(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's chosen expert ids [T, k] on the one-rank row ``ids``."""
    chosen: list[torch.Tensor] = []
    hooks = [b.gate.register_forward_hook(lambda m, a, out: chosen.append(out[1])) for b in moe_blocks(model)]
    shard = shard_of((len(ids),))
    with torch.no_grad():
        model.logits(zigzag_slice(ids, shard.plan), shard)
    for h in hooks:
        h.remove()
    return chosen


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_differs_per_token(checkpoints, family):
    model = load_hf(checkpoints / family)
    ids = packed_tokens((40,), model.config.vocab_size, seed=3)
    for chosen in _routing(model, ids):
        sets = {tuple(sorted(row.tolist())) for row in chosen}
        assert len(sets) >= 10 and len(chosen.unique()) == model.config.num_experts, sets


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_both_ways(checkpoints, tmp_path, family):
    """transformers save -> our load (per-expert keys); our save -> transformers load, identical logits;
    a checkpoint with transformers' fused in-memory keys loads too."""
    ours = load_hf(checkpoints / family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints / family, dtype=torch.float32, attn_implementation="eager"
    )
    save_hf(ours, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    saved = set(saved)
    assert saved == set(load_file(checkpoints / family / "model.safetensors"))  # transformers' own key set
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, attn_implementation="eager"
    )
    ids = packed_tokens((9,), ours.config.vocab_size, seed=4)
    shard = shard_of((9,))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids[None]).logits, hf(input_ids=ids[None]).logits)
        mine = ours.logits(zigzag_slice(ids, shard.plan), shard)[:9]
        assert (mine - hf(input_ids=ids[None]).logits[0]).abs().max() < 1e-5
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((checkpoints / family / "config.json").read_text())
    fused = {n: t.contiguous() for n, t in hf.state_dict().items() if n != "lm_head.weight" or n in saved}
    save_file(fused, fused_dir / "model.safetensors")
    again = load_hf(fused_dir)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_unknown_model_and_missing_expert_are_named(checkpoints, tmp_path):
    config = json.loads((checkpoints / "qwen3_moe" / "config.json").read_text())
    bad = tmp_path / "mixtral"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(UserInputError, match="model_type='mixtral'"):
        load_hf(bad)
    holey = tmp_path / "holey"
    holey.mkdir()
    (holey / "config.json").write_text(json.dumps(config))
    tensors = load_file(checkpoints / "qwen3_moe" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, holey / "model.safetensors")
    with pytest.raises(UserInputError, match=r"missing tensors \['model\.layers\.1\.mlp\.experts\.5\.up_proj"):
        load_hf(holey)


def test_replay_uses_given_experts_and_router_gradients(checkpoints):
    """Replaying the router's own choice is the plain forward; replaying others equals a per-token loop."""
    block = next(b for b in moe_blocks(load_hf(checkpoints / "qwen3_5_moe", dtype=torch.float64)))
    x = torch.randn(12, block.gate.weight.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    _, own = block.gate(x)
    assert torch.equal(block(x, own), block(x))
    replay = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(12)])
    got = block(x, replay)
    got.sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().max() > 0
    probs = torch.softmax(x @ block.gate.weight.detach().t(), -1)
    e = block.experts
    want = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    for t in range(12):
        w = probs[t, replay[t]] / probs[t, replay[t]].sum()
        for j, k in enumerate(replay[t].tolist()):
            gate, up = (e.gate_up_proj[k] @ x[t]).chunk(2)
            want[t] = want[t] + w[j] * (e.down_proj[k] @ (torch.nn.functional.silu(gate) * up))
    assert (got - want).abs().max() < 1e-12
    with pytest.raises(UserInputError, match=r"ids must be in \[0, num_experts=8\)"):
        block(x, replay + 7)
    with pytest.raises(UserInputError, match=r"replay_experts must be int \[12, top_k=2\]"):
        block(x, replay[:, :1])


@pytest.mark.parametrize("norm", [False, True])
def test_router_equals_transformers(norm):
    config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    ours = TopKRouter(16, 8, 3, norm)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    x = torch.randn(20, 16)
    _, want_w, want_ids = theirs(x)
    got_w, got_ids = ours(x)
    assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, rtol=1e-6, atol=0)


def test_grouped_mm_forward_equals_loop():
    """torch's grouped GEMM (forward; its CPU backward fails in torch 2.13, so CPU picks the loop) = the loop."""
    x = torch.randn(10, 8)
    w = torch.randn(3, 12, 8)
    counts = torch.tensor([4, 0, 6])
    want = GROUPED_LINEAR["loop"](x, w, counts)
    assert torch.allclose(GROUPED_LINEAR["grouped_mm"](x, w, counts), want, rtol=1e-5, atol=1e-5)


def test_replay_through_the_decoder(checkpoints):
    """``PackedShard.replay_experts`` reaches every MoE layer: its own routing replayed gives the same logits;
    another routing in one layer changes them; a wrong entry count is refused."""
    import dataclasses

    model = load_hf(checkpoints / "qwen3_5_moe", dtype=torch.float64)
    ids = packed_tokens((16,), model.config.vocab_size, seed=6)
    chosen = _routing(model, ids)
    shard = shard_of((16,))
    local = zigzag_slice(ids, shard.plan)
    with torch.no_grad():
        plain = model.logits(local, shard)
        replayed = model.logits(local, dataclasses.replace(shard, replay_experts=tuple(chosen)))
        other = (chosen[2] + 1) % model.config.num_experts
        changed = model.logits(local, dataclasses.replace(shard, replay_experts=(None, None, other, None)))
    assert torch.equal(replayed, plain)
    assert (changed - plain).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"one entry per layer \(4\)"):
        model.logits(local, dataclasses.replace(shard, replay_experts=(None,)))


def test_serve_preflight_refuses_bad_ep(checkpoints, tmp_path):
    """``ringtune serve --ep``: refused by name before any rank starts when it cannot shard the experts."""
    from ringtune.worker.preflight import ServeSettings, preflight

    moe = str(checkpoints / "qwen3_5_moe")
    preflight(ServeSettings(source=moe, cp=2, ep=2))  # fits
    with pytest.raises(UserInputError, match=r"--ep=3 must divide --dp x --cp = 4"):
        preflight(ServeSettings(source=moe, dp=2, cp=2, ep=3))
    with pytest.raises(UserInputError, match=r"--ep=3 must divide the model's num_experts=8"):
        preflight(ServeSettings(source=moe, dp=3, ep=3))
    with pytest.raises(UserInputError, match=r"--shard-params=dp with --ep=2"):
        preflight(ServeSettings(source=moe, dp=2, ep=2, shard_params="dp"))
    preflight(ServeSettings(source=moe, dp=2, cp=2, ep=2))  # two expert replicas across DP fit (hang fixed)
    preflight(ServeSettings(source=moe, dp=2, cp=2, ep=4))  # EP over all dp x cp ranks fits
    hf_model("qwen3", seed=0).save_pretrained(tmp_path / "dense")
    notes = preflight(ServeSettings(source=str(tmp_path / "dense"), routing_replay=True)).notes
    assert "--routing-replay has nothing to record: the model has no MoE layer" in notes
    with pytest.raises(UserInputError, match=r"num_experts=0 \(0: not MoE\)"):
        preflight(ServeSettings(source=str(tmp_path / "dense"), cp=2, ep=2))


def test_grouped_linear_of_no_rows_stays_in_the_graph():
    """An EP rank that received no token in a layer must still run the backward of the all-to-all that brought
    none (its peers run theirs; a skipped one hung DP2xCP2xEP2): the empty expert output stays connected."""
    from ringtune.models.layers.moe import grouped_linear_loop

    x = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(3, 5, 4, requires_grad=True)
    out = grouped_linear_loop(x, w, torch.zeros(3, dtype=torch.int64))
    assert out.shape == (0, 5) and out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and w.grad is not None and not w.grad.any()
