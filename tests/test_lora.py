"""LoRA runs (ringtune.models.lora, ringtune.engine.lora_trainer) on 4 gloo ranks.

- float32 log-probs and adapter gradients equal Hugging Face ``peft`` (same adapter weights, alpha 32) at
  CP 1/2/4: a tied (Qwen3) and an untied (Llama) model, every target group including the unembedding;
- float64 layout invariance of a LoRA trainer (Qwen3.5 hybrid: GatedDeltaNet's split q/k/v adapters) at
  (DP, CP) in {(1,1), (1,2), (2,1), (2,2), (1,4)}, with recomputation: outputs, adapter gradients and
  post-step adapters within 1e-10;
- the merged model (sampler snapshot) computes the LoRA run's log-probs; save/load of adapters + moments;
  bf16-mixed and the spec's checks.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
from support.lora import randomize_adapters
from support.tiny_models import hf_model, hf_row_logprobs, next_token_labels, packed_tokens

from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.errors import UserInputError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.lora import LoraModel, LoraSpec
from ringtune.models.lora_merge import merged_model
from ringtune.models.lora_peft import write_peft_adapter
from ringtune.models.shard import shard_of

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LENS = (5, 17, 3, 40, 9)
LAYOUTS = ((1, 1, "none"), (1, 2, "none"), (2, 1, "none"), (2, 2, "full"), (1, 4, "selective"))
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
RANK = 4


def row_logprobs(model, ids, labels, shard) -> torch.Tensor:
    """This rank's log-probs of the packed row (zigzag shard)."""
    return model.label_logprobs(zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)


def peft_case(ctx, *, root: str, family: str):
    """Ours at CP 1/2/4 against peft on the same adapters; returns (max |Δ lp|, max relative grad diff) per CP."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    hf = get_peft_model(
        hf_model(family, seed=7), LoraConfig(r=RANK, lora_alpha=32, target_modules=PEFT_TARGETS, lora_dropout=0.0)
    )
    ours = LoraModel(load_hf(pathlib.Path(root) / family, dtype=torch.float32), LoraSpec(rank=RANK, seed=1))
    randomize_adapters(ours, seed=11)
    peft_params = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".lora_" in name:
                module = name.split("base_model.model.")[1].split(".lora_")[0]
                a, b = ours.adapters.pair(module)
                p.copy_(a if ".lora_A." in name else b)
                peft_params[name] = (p, a if ".lora_A." in name else b)
    assert len(peft_params) == 2 * len(ours.adapters.targets)
    ids = packed_tokens(LENS, ours.config.vocab_size, seed=3)
    labels = next_token_labels(ids, LENS)
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(4))
    ref_lp = hf_row_logprobs(hf, ids, labels, LENS)  # one sequence at a time through transformers + peft
    (ref_lp * weights).sum().backward()
    out = {}
    for cp in (1, 2, 4):
        mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
        shard = shard_of(LENS, cp_size=cp, cp_rank=mesh.cp_rank, group=mesh.cp_group, pad_multiplier=4)
        ours.zero_grad(set_to_none=True)
        lp = row_logprobs(ours, ids, labels, shard)
        (lp * zigzag_slice(weights, shard.plan)).sum().backward()
        real = shard.plan.is_real
        lp_err = float((lp[real].detach() - ref_lp[shard.plan.row_index[real]].detach()).abs().max())
        grad_err = 0.0
        for p, mine in peft_params.values():
            g = mine.grad.clone()
            dist.all_reduce(g, group=mesh.cp_group)
            grad_err = max(grad_err, float((g - p.grad).abs().max() / p.grad.abs().max()))
        out[cp] = (lp_err, grad_err)
    return out


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    for family, seed in (("llama", 7), ("qwen3", 7), ("qwen3_5", 21)):
        hf_model(family, seed=seed).save_pretrained(root / family)
    return str(root)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float32_matches_peft_at_cp_1_2_4(pool4, roots, family):
    for result in pool4.run(peft_case, root=roots, family=family):
        for cp, (lp_err, grad_err) in result.items():
            # float32: ours packs the row and sums tiles in another order than transformers' per-sequence
            # eager forward; measured 1e-6 (log-probs) and 6e-6 (relative gradient), limits 10-20x that.
            assert lp_err <= 2e-5, (family, cp, lp_err)
            assert grad_err <= 1e-4, (family, cp, grad_err)


def make_data(vocab: int, loss_fn: str) -> list[TrainDatum]:
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in LENS:
        inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.randn(n, generator=gen, dtype=torch.float64)
        else:
            inputs["logprobs"] = -torch.rand(n, generator=gen, dtype=torch.float64) * 5
            inputs["advantages"] = torch.randn(n, generator=gen, dtype=torch.float64)
        data.append(TrainDatum(tokens=torch.randint(0, vocab, (n,), generator=gen), inputs=inputs))
    return data


def invariance_case(ctx, *, root: str, loss_fn: str):
    results = {}
    base = load_hf(pathlib.Path(root) / "qwen3_5", dtype=torch.float64)
    for dp, cp, recompute in LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp)
        model = LoraModel(base, LoraSpec(rank=RANK, seed=5))  # every layout's run shares the one base
        randomize_adapters(model, seed=9)
        gated_delta = "chunkwise" if cp == 4 else "headwise"
        trainer = LoraTrainer(model, mesh, max_tokens_per_rank=48, gated_delta=gated_delta, recompute=recompute)
        result = trainer.forward_backward(make_data(base.config.vocab_size, loss_fn), loss_fn)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=trainer.dp_cp_group)
        trainer.optim_step(ADAM)
        assert all(not p.requires_grad for p in base.parameters())
        if trainer.is_result_rank:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            results[dp, cp] = (result.metrics["loss:sum"], result.outputs, grads, weights)
    return results


def _max(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_layout_invariance_float64(pool4, roots, loss_fn):
    runs = {k: v for res in pool4.run(invariance_case, root=roots, loss_fn=loss_fn) for k, v in res.items()}
    assert set(runs) == {(dp, cp) for dp, cp, _ in LAYOUTS}
    ref_loss, ref_out, ref_grads, ref_weights = runs[1, 1]
    assert any(k.startswith("adapters.lora_A.model-layers-0-linear_attn-in_proj_q") for k in ref_grads)
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 0
    for key, (loss, outputs, grads, weights) in runs.items():
        assert abs(loss - ref_loss) <= 1e-10 * max(1.0, abs(ref_loss)), key
        for got, want in zip(outputs, ref_out, strict=True):
            assert _max(got, want) <= 1e-10, key
        assert _max(grads, ref_grads) <= 1e-10, key
        assert _max(weights, ref_weights) <= 1e-10, key


def state_case(ctx, *, root: str, path: str):
    """At CP 2: the merged model's log-probs, save/load of adapters + moments, bf16-mixed against float32."""
    mesh = ctx.mesh(dp=2, cp=2)
    out = {}
    base = load_hf(pathlib.Path(root) / "qwen3_5", dtype=torch.float64)
    model = LoraModel(base, LoraSpec(rank=RANK, seed=5))
    randomize_adapters(model, seed=9)
    ids = packed_tokens(LENS, base.config.vocab_size, seed=3)
    labels = next_token_labels(ids, LENS)
    with torch.no_grad():
        shard = shard_of(LENS, cp_size=2, cp_rank=mesh.cp_rank, group=mesh.cp_group, pad_multiplier=4)
        merged = merged_model(model)
        assert not merged.config.tie_word_embeddings and merged.lm_head is not None  # untied by the unembedding
        adapted, plain = row_logprobs(model, ids, labels, shard), row_logprobs(merged, ids, labels, shard)
        out["merged"] = float((adapted - plain).abs().max())
    trainer = LoraTrainer(model, mesh, max_tokens_per_rank=64)
    data = make_data(base.config.vocab_size, "cross_entropy")
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(ADAM)
    trainer.save_state(path)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: trainer.optimizer.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()}
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(ADAM)
    out["moved"] = _max({n: p.detach() for n, p in model.named_parameters()}, saved)
    trainer.load_state(path)
    out["restored"] = _max({n: p.detach() for n, p in model.named_parameters()}, saved)
    restored = {n: trainer.optimizer.state[p]["exp_avg_sq"] for n, p in model.named_parameters()}
    out["moments"] = _max(restored, moments)
    out["step"] = trainer.step
    other = LoraTrainer(LoraModel(base, LoraSpec(rank=RANK + 1, seed=5)), mesh, max_tokens_per_rank=64)
    try:
        other.load_state(path)
        out["other_rank"] = "loaded"
    except UserInputError as exc:
        out["other_rank"] = str(exc)
    # bf16-mixed against float32 (both at CP 2) on the same adapters
    lps = {}
    for dtype in ("float32", "bf16-mixed"):
        model32 = LoraModel(load_hf(pathlib.Path(root) / "qwen3_5", dtype=torch.float32), LoraSpec(rank=RANK, seed=5))
        randomize_adapters(model32, seed=9, std=0.03)  # at 0.1 (delta ~ base weights) this tiny net is chaotic in bf16
        mixed = {"compute_dtype": torch.bfloat16} if dtype == "bf16-mixed" else {}
        t = LoraTrainer(model32, mesh, max_tokens_per_rank=64, **mixed)
        res = t.forward_backward(data, "cross_entropy")
        grads = torch.cat([p.grad.flatten() for p in model32.parameters()])
        dist.all_reduce(grads, group=mesh.dp_cp_group)
        lps[dtype] = (res.outputs, grads)
    if lps["float32"][0] is not None:
        out["bf16_lp"] = max(
            float((a["logprobs"] - b["logprobs"]).abs().max())
            for a, b in zip(lps["float32"][0], lps["bf16-mixed"][0], strict=True)
        )
    g32, g16 = lps["float32"][1], lps["bf16-mixed"][1]
    out["bf16_grad_cos"] = float(g32 @ g16 / (g32.norm() * g16.norm()))
    return out


def test_merged_model_checkpoint_and_bf16_mixed(pool4, roots, tmp_path):
    results = pool4.run(state_case, root=roots, path=str(tmp_path / "ckpt"))
    for r in results:
        assert r["merged"] <= 1e-10  # float64: the merged weights compute the adapted function
        assert r["moved"] > 0 and r["restored"] == 0.0 and r["moments"] == 0.0 and r["step"] == 1
        assert "lora_A" in r["other_rank"] or "shape" in r["other_rank"], r["other_rank"]
        # bf16 layers (8-bit mantissa): measured cos 0.99995 (per tensor <= 0.02 relative, as for full weights)
        assert r["bf16_grad_cos"] > 0.999
    assert 1e-5 < results[0]["bf16_lp"] <= 0.05  # bf16 shows, within test_mixed_precision's LOGPROB_ATOL


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_peft_export_loads_in_peft(roots, tmp_path, family):
    """The PEFT export (GatedDeltaNet's split q/k/v as one rank-3r adapter) loads onto the transformers model with
    no missing or unexpected key and computes our log-probs."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    ours = LoraModel(load_hf(pathlib.Path(roots) / family, dtype=torch.float32), LoraSpec(rank=RANK, seed=1))
    randomize_adapters(ours, seed=11, std=0.05)
    write_peft_adapter(ours, tmp_path)
    seed = 21 if family == "qwen3_5" else 7
    model = get_peft_model(hf_model(family, seed=seed), LoraConfig.from_pretrained(tmp_path))
    loaded = set_peft_model_state_dict(model, load_file(tmp_path / "adapter_model.safetensors"))
    assert loaded.unexpected_keys == [] and [k for k in loaded.missing_keys if "lora_" in k] == []
    ids = packed_tokens(LENS, ours.config.vocab_size, seed=3)
    labels = next_token_labels(ids, LENS)
    shard = shard_of(LENS)
    with torch.no_grad():
        lp = row_logprobs(ours, ids, labels, shard)
        ref = hf_row_logprobs(model, ids, labels, LENS)
    real = shard.plan.is_real
    assert float((lp[real] - ref[shard.plan.row_index[real]]).abs().max()) <= 1e-5  # measured 1e-6


def keep_block_diagonal(peft_model, r: int) -> int:
    """docs/lora.md's gradient mask: every fused ``in_proj_qkv`` ``lora_B`` of a GatedDeltaNet trains only its
    diagonal blocks (q, k, v rows x their r columns), so peft trains ringtune's three rank-r adapters. Returns
    how many modules it masked."""
    text = peft_model.base_model.model.config.get_text_config()
    key = text.linear_num_key_heads * text.linear_key_head_dim
    value = text.linear_num_value_heads * text.linear_value_head_dim
    mask = torch.block_diag(torch.ones(key, r), torch.ones(key, r), torch.ones(value, r))  # [2 key + value, 3r]
    masked = 0
    for name, module in peft_model.named_modules():
        if name.endswith("linear_attn.in_proj_qkv") and hasattr(module, "lora_B"):
            weight = module.lora_B["default"].weight
            block_mask = mask.to(weight)
            weight.register_hook(lambda grad, m=block_mask: grad * m)
            masked += 1
    return masked


def test_peft_training_of_the_fused_qkv_adapter_needs_the_block_mask(roots, tmp_path):
    """Trained further in peft, the exported rank-3r ``in_proj_qkv`` adapter moves its off-diagonal blocks (another
    parameterisation than ringtune's three rank-r adapters); with :func:`keep_block_diagonal` its gradients are
    exactly ours laid out by the exporter, and an AdamW step keeps the off-diagonal blocks at 0."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    from ringtune.models.lora_peft import peft_tensors

    ours = LoraModel(load_hf(pathlib.Path(roots) / "qwen3_5", dtype=torch.float32), LoraSpec(rank=RANK, seed=1))
    randomize_adapters(ours, seed=11, std=0.05)
    write_peft_adapter(ours, tmp_path)
    ids = packed_tokens(LENS, ours.config.vocab_size, seed=3)
    labels = next_token_labels(ids, LENS)
    shard = shard_of(LENS)
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(4))
    (
        row_logprobs(ours, ids, labels, shard) * weights[shard.plan.row_index.clamp(min=0)] * shard.plan.is_real
    ).sum().backward()
    grads, _ = peft_tensors(ours.spec, [(t, a.grad, b.grad) for t, a, b in ours.adapters.named_pairs()])

    def peft_grads(mask: bool):
        config = LoraConfig.from_pretrained(tmp_path)
        config.inference_mode = False  # the export is written for inference; training it needs trainable adapters
        model = get_peft_model(hf_model("qwen3_5", seed=21), config)
        set_peft_model_state_dict(model, load_file(tmp_path / "adapter_model.safetensors"))
        masked = keep_block_diagonal(model, RANK) if mask else 0
        (hf_row_logprobs(model, ids, labels, LENS) * weights).sum().backward()
        params = dict(model.named_parameters())
        return model, masked, {k: params[k.replace(".weight", ".default.weight")].grad for k in grads}

    _, _, free = peft_grads(mask=False)
    model, masked, kept = peft_grads(mask=True)
    fused = [k for k in grads if "in_proj_qkv.lora_B" in k]
    assert masked == len(fused) > 0
    for k in fused:
        off_diagonal = grads[k] == 0  # the exporter's block_diag of our three B gradients is 0 off its blocks
        assert float(free[k][off_diagonal].abs().max()) > 1e-6  # unmasked, peft would move them
        assert float(kept[k][off_diagonal].abs().max()) == 0.0
    for k in grads:
        # float32: ours packs the row, transformers runs one sequence at a time; measured ~1e-6 relative
        assert float((kept[k] - grads[k]).abs().max()) <= 1e-4 * float(grads[k].abs().max()), k
    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_" in n], lr=1e-2)
    optimizer.step()
    params = dict(model.named_parameters())
    for k in fused:
        after = params[k.replace(".weight", ".default.weight")]
        assert float(after.detach()[grads[k] == 0].abs().max()) == 0.0


def test_spec_checks():
    for bad, field in (
        (LoraSpec(rank=0), "rank"),
        (LoraSpec(rank=2000), "rank"),
        (LoraSpec(rank=True), "rank"),  # type: ignore[arg-type]
        (LoraSpec(rank=4, seed=-1), "seed"),
        (LoraSpec(rank=4, train_attn=False, train_mlp=False, train_unembed=False), "at least one"),
    ):
        with pytest.raises(UserInputError, match=field):
            bad.validate()
    assert LoraSpec(rank=32).scale == 1.0
    moe = load_hf_model_moe()  # layers 0, 1, 3 sparse (routed experts, no shared expert), layer 2 dense
    names = [t.name for t in LoraModel(moe, LoraSpec(rank=2)).adapters.targets]
    assert "model.layers.0.mlp.experts.down_proj" in names and "model.layers.2.mlp.gate_proj" in names
    assert not any("mlp.gate." in n or n.endswith("mlp.gate") for n in names)  # the router is not adapted
    assert not any(".mlp." in t.name for t in LoraModel(moe, LoraSpec(rank=2, train_mlp=False)).adapters.targets)


def load_hf_model_moe():
    from support.tiny_models import hf_config

    from ringtune.models.config import DecoderConfig
    from ringtune.models.decoder import CausalLM

    return CausalLM(DecoderConfig.from_hf(hf_config("qwen3_moe").to_dict()))


def test_admission_counts_memory():
    """``max_live_runs`` in full-run equivalents: four full runs as before, many LoRA runs on the shared base."""
    from support.tiny_models import hf_config

    from ringtune.gateway.backend import BackendInfo
    from ringtune.gateway.run_memory import check_admission
    from ringtune.models.config import DecoderConfig
    from ringtune.models.decoder import CausalLM
    from ringtune.models.lora import lora_params_per_rank

    with torch.device("meta"):
        model = CausalLM(DecoderConfig.from_hf(hf_config("llama").to_dict()))
    groups = lora_params_per_rank(model)
    # hidden 32, 4 q heads and 2 kv heads of 8, MLP 48, vocab 96, 4 layers: per layer q 64 + k 48 + v 48 + o 64
    assert groups == {"attn": 4 * 224, "mlp": 4 * 3 * (32 + 48), "unembed": 96 + 32}
    params = sum(p.numel() for p in model.parameters())
    info = BackendInfo(
        model_name="m", arch="llama", tokenizer_dir=None, context_length=64, max_tokens_per_rank=64,
        dtype="float32", vocab_size=96, param_count=params, lora_params_per_rank=groups,
    )  # fmt: skip
    full: list = []
    for _ in range(4):
        check_admission(info, full, None, max_live_runs=4)
        full.append(None)
    with pytest.raises(UserInputError, match="the limit is 4 full-run equivalents"):
        check_admission(info, full, None, max_live_runs=4)
    spec = LoraSpec(rank=2, seed=0).to_dict()
    lora: list = []
    while True:
        try:
            check_admission(info, lora, spec, max_live_runs=4)
        except UserInputError as exc:
            assert "LoRA run of rank 2" in str(exc)
            break
        lora.append(spec)
    # budget 16·P; the shared base P once; each run 4 × 2 × (896 + 960 + 128) parameters
    assert len(lora) == (15 * params) // (4 * 2 * (896 + 960 + 128))
    blind = BackendInfo(**{**info.__dict__, "param_count": 0})  # unknown size: runs are counted
    with pytest.raises(UserInputError, match="the limit is 1"):
        check_admission(blind, [spec], spec, max_live_runs=1)


def test_executor_shares_one_base_and_frees_a_run(roots):
    """Two LoRA runs on one rank hold the same frozen base; a fresh run computes the base (B = 0) like a full
    fine-tuning run beside it; freeing the run whose adapters are active drops them from the base's hooks."""
    from ringtune.worker.commands import Command
    from ringtune.worker.executor import ModelSpec, RankExecutor

    executor = RankExecutor(
        ModelSpec(source=str(pathlib.Path(roots) / "llama"), dtype="float64", max_tokens_per_rank=64), None
    )
    spec = LoraSpec(rank=2, seed=0).to_dict()
    for run_id, lora in (("a", spec), ("b", spec), ("full", None)):
        executor.execute(Command("create_run", run_id, {"lora": lora}))
    a, b = executor.trainers["a"], executor.trainers["b"]
    assert a.lora.base is b.lora.base and a.lora.adapters is not b.lora.adapters
    data = make_data(96, "cross_entropy")
    args = {"data": data, "loss_fn": "cross_entropy", "loss_config": None, "forward_only": True}
    losses = {r: executor.execute(Command("forward_backward", r, args))[1]["loss:sum"] for r in ("a", "full")}
    assert abs(losses["a"] - losses["full"]) <= 1e-12 * abs(losses["full"])
    executor.execute(Command("free_run", "a"))
    assert a.lora.slot.active is None and "a" not in executor.trainers
