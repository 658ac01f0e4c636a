"""LoRA on MoE layers (ringtune.models.lora): the routed experts as hosted Tinker adapts them and the shared
expert, on 4 gloo ranks.

- the adapter parameters per unit of rank of Qwen3-30B-A3B and Qwen3.5-35B-A3B (built on the meta device at
  their real sizes) equal the cookbook's table of hosted Tinker's counts, group by group;
- float32 log-probs and adapter gradients equal transformers + ``peft`` at CP 1/2/4 (Qwen3-MoE and the
  Qwen3.5-MoE hybrid, randomised routers): peft loads our PEFT export (routed experts as ``target_parameters``),
  and its gradients are mapped back onto our adapters through the export's own (linear) map;
- float64: layout invariance of expert adapter gradients and post-step adapters over (DP, CP); the merged model
  computes the run's function; a run with expert adapters passed to ``forward_backward_many`` beside another
  runs alone and gets what it gets alone; its sampler snapshot decodes in a batch of its own.
"""

from __future__ import annotations

import pathlib
import tempfile

import pytest
import torch
import torch.distributed as dist
from support.lora import randomize_adapters
from support.tiny_models import hf_model, hf_row_logprobs, next_token_labels, packed_tokens
from test_lora_batch import make_data  # importance-sampling datums (tests/ is on the path, as for the fixtures)

from ringtune.engine.lora_batch import forward_backward_many
from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.optimizer import AdamParams
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.logprob_head import label_logprobs
from ringtune.models.lora import LoraModel, LoraSpec, lora_params_per_rank
from ringtune.models.lora_merge import merged_model
from ringtune.models.lora_peft import PREFIX, peft_tensors, write_peft_adapter
from ringtune.models.lora_snapshot import LoraSnapshot
from ringtune.models.shard import shard_of
from ringtune.sample.shared_decode import decode_base

RANK = 4
LENS = (5, 17, 3, 40, 9)
# PEFT's transformers-v4 compatibility rewrites every target named gate/up/down_proj of a Qwen3-MoE into the
# experts' fused parameters, so a Qwen3-MoE with dense layers (mlp_only_layers) cannot carry dense-MLP adapters
# in PEFT (docs/lora.md); the real Qwen3-MoE checkpoints have none, nor has this one.
OVERRIDES = {"qwen3_moe": {"mlp_only_layers": []}, "qwen3_5_moe": {}}
LAYOUTS = (
    (1, 1, "none", "headwise"),
    (1, 2, "none", "headwise"),
    (2, 2, "full", "headwise"),
    (1, 4, "selective", "chunkwise"),
)
EP_LAYOUTS = ((1, 2, 2), (2, 2, 4), (1, 4, 2))
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    for family, overrides in OVERRIDES.items():
        hf_model(family, seed=7, **overrides).save_pretrained(root / family)
    return str(root)


def test_parameter_counts_match_hosted_tinker():
    """Per-rank adapter parameters by group = ``tinker_cookbook.hyperparam_utils``' table (hosted Tinker's)."""
    import transformers
    from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT as TABLE

    from ringtune.models.config import DecoderConfig
    from ringtune.models.decoder import CausalLM

    qwen3 = transformers.Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    )
    qwen35 = transformers.Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=2048,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
    )
    for name, config in (("Qwen/Qwen3-30B-A3B", qwen3), ("Qwen/Qwen3.5-35B-A3B", qwen35)):
        with torch.device("meta"):
            model = CausalLM(DecoderConfig.from_hf(config.to_dict()))
        assert lora_params_per_rank(model) == TABLE[name], name


def peft_case(ctx, *, root: str, family: str):
    """Ours at CP 1/2/4 against peft (loaded from our export); (max |Δ lp|, max relative grad diff) per CP."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    ours = LoraModel(load_hf(pathlib.Path(root) / family, dtype=torch.float32), LoraSpec(rank=RANK, seed=1))
    randomize_adapters(ours, seed=11, std=0.05)
    assert any(t.experts for t in ours.adapters.targets)
    export = pathlib.Path(tempfile.mkdtemp(prefix=f"peft{ctx.rank}-"))
    write_peft_adapter(ours, export)
    hf = get_peft_model(hf_model(family, seed=7, **OVERRIDES[family]), LoraConfig.from_pretrained(export))
    loaded = set_peft_model_state_dict(hf, load_file(export / "adapter_model.safetensors"))
    assert loaded.unexpected_keys == [] and [k for k in loaded.missing_keys if "lora_" in k] == []
    peft_params = {n.replace(".default", ""): p for n, p in hf.named_parameters() if ".lora_" in n}
    for p in peft_params.values():
        p.requires_grad_(True)
    ids = packed_tokens(LENS, ours.config.vocab_size, seed=3)
    labels = next_token_labels(ids, LENS)
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(4))
    ref_lp = hf_row_logprobs(hf, ids, labels, LENS)  # one sequence at a time through transformers + peft
    (ref_lp * weights).sum().backward()
    pairs = list(ours.adapters.named_pairs())
    # peft's gradients onto our adapters: the adjoint of the export map (repeat -> sum over experts, ...)
    leaves = [(t, a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for t, a, b in pairs]
    tensors, _ = peft_tensors(ours.spec, leaves)
    assert set(tensors) == {k for k in peft_params if k.startswith(PREFIX)}
    torch.autograd.backward([tensors[k] for k in tensors], [peft_params[k].grad for k in tensors])
    want = {t.name: (a.grad, b.grad) for t, a, b in leaves}
    out = {}
    for cp in (1, 2, 4):
        mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
        shard = shard_of(LENS, cp_size=cp, cp_rank=mesh.cp_rank, group=mesh.cp_group, pad_multiplier=4)
        ours.zero_grad(set_to_none=True)
        lp = ours.label_logprobs(zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)
        (lp * zigzag_slice(weights, shard.plan)).sum().backward()
        real = shard.plan.is_real
        lp_err = float((lp[real].detach() - ref_lp[shard.plan.row_index[real]].detach()).abs().max())
        grad_err = 0.0
        for target, a, b in ours.adapters.named_pairs():
            for mine, ref_grad in zip((a, b), want[target.name], strict=True):
                g = torch.zeros_like(mine) if mine.grad is None else mine.grad.clone()
                dist.all_reduce(g, group=mesh.cp_group)
                grad_err = max(grad_err, float((g - ref_grad).abs().max() / ref_grad.abs().max()))
        out[cp] = (lp_err, grad_err)
    return out


@pytest.mark.parametrize("family", list(OVERRIDES))
def test_float32_matches_peft_at_cp_1_2_4(pool4, roots, family):
    for rank, result in enumerate(pool4.run(peft_case, root=roots, family=family)):
        for cp, (lp_err, grad_err) in result.items():
            if rank == 0:
                print(f"\n{family} CP {cp}: max |Δ log-prob| {lp_err:.1e}, rel. adapter-grad diff {grad_err:.1e}")
            # float32: ours packs the row, groups tokens by expert and sums tiles in another order than
            # transformers' per-sequence eager forward and peft's merged expert weights; the dense models
            # measure 1e-6 / 6e-6 (test_lora.py), limits 10-20x that.
            assert lp_err <= 2e-5, (family, cp, lp_err)
            assert grad_err <= 1e-4, (family, cp, grad_err)


def float64_case(ctx, *, root: str, export: str):
    base = load_hf(pathlib.Path(root) / "qwen3_5_moe", dtype=torch.float64)
    vocab = base.config.vocab_size
    data = make_data(vocab, (5, 17, 1, 40, 9), seed=3)
    out: dict = {}
    for dp, cp, recompute, gated_delta in LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp)
        model = LoraModel(base, LoraSpec(rank=RANK, seed=5))
        randomize_adapters(model, seed=9)
        trainer = LoraTrainer(model, mesh, max_tokens_per_rank=48, gated_delta=gated_delta, recompute=recompute)
        result = trainer.forward_backward(data, "importance_sampling")
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=trainer.dp_cp_group)
        trainer.optim_step(ADAM)
        if trainer.is_result_rank:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            out[dp, cp] = (result.metrics["loss:sum"], result.outputs, grads, weights)
    # expert parallelism: the shared base's experts sharded over EP (a base per layout: sharding is in place),
    # the adapters whole; the sampler snapshot and the merged export run on a copy with every expert
    for dp, cp, ep in EP_LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp, ep=ep)
        model = LoraModel(load_hf(pathlib.Path(root) / "qwen3_5_moe", dtype=torch.float64), LoraSpec(rank=RANK, seed=5))
        randomize_adapters(model, seed=9)
        trainer = LoraTrainer(model, mesh, max_tokens_per_rank=48, gated_delta="chunkwise")
        assert model.base.model.layers[0].mlp.experts.num_local == 8 // ep
        result = trainer.forward_backward(data, "importance_sampling")
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=trainer.dp_cp_group)
        trainer.optim_step(ADAM)
        after = trainer.forward(data, "importance_sampling")
        snapshot = trainer.sampler_snapshot()  # collective the first time (gathers the experts)
        # one directory per replica: at DP1×CP2 the pool runs two replicas side by side, and two writers of one
        # path would swap the directory under the other's reader
        where = f"{export}-{dp}{cp}{ep}-{dist.get_global_rank(trainer.control_group, 0)}"
        trainer.export_hf(where)
        if trainer.is_result_rank:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            out[dp, cp, ep] = (result.metrics["loss:sum"], result.outputs, grads, weights)
            lens = [len(d.tokens) for d in data]
            ids, labels = torch.cat([d.tokens for d in data]), torch.cat([d.inputs["target_tokens"] for d in data])
            want = torch.cat([o["logprobs"] for o in after.outputs])
            exported = load_hf(where, dtype=torch.float64)
            with torch.no_grad():
                shard = shard_of(lens)
                args = (zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100))
                hidden = snapshot.hidden_states(args[0], shard)
                lp = label_logprobs(hidden, snapshot.output_weight, args[1])
                lp_export = exported.label_logprobs(*args, shard)
            real = shard.plan.is_real
            out[f"EP{ep} snapshot"] = float((lp[real] - want[shard.plan.row_index[real]]).abs().max())
            out[f"EP{ep} export"] = float((lp_export[real] - want[shard.plan.row_index[real]]).abs().max())
    # the merged model (a full checkpoint of the run) computes the run's log-probs
    model = LoraModel(base, LoraSpec(rank=RANK, seed=5))
    randomize_adapters(model, seed=9)
    ids = packed_tokens(LENS, vocab, seed=3)
    labels = next_token_labels(ids, LENS)
    with torch.no_grad():
        shard = shard_of(LENS)
        merged = merged_model(model)
        args = (zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)
        out["merged"] = float((model.label_logprobs(*args) - merged.label_logprobs(*args)).abs().max())
    out["decode_base"] = decode_base(LoraSnapshot(model)) is not base
    # an expert run beside an attention-only run in forward_backward_many: each gets what it gets alone
    mesh = ctx.mesh(dp=1, cp=2)
    results = {}
    for joined in (False, True):
        specs = (LoraSpec(rank=RANK, seed=5), LoraSpec(rank=2, seed=6, train_mlp=False))
        trainers = []
        for i, spec in enumerate(specs):
            run = LoraModel(base, spec)
            randomize_adapters(run, seed=30 + i)
            trainers.append(LoraTrainer(run, mesh, max_tokens_per_rank=48))
        runs_data = [data, make_data(vocab, (7, 3), seed=4)]
        if joined:
            outcomes = forward_backward_many(trainers, runs_data, "importance_sampling")
        else:
            outcomes = [t.forward_backward(d, "importance_sampling") for t, d in zip(trainers, runs_data, strict=True)]
        results[joined] = []
        for t, o in zip(trainers, outcomes, strict=True):
            grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
            results[joined].append((o.metrics.get("loss:sum", 0.0), grads))
    out["many"] = max(
        max(abs(a[0] - b[0]), *(float((a[1][k] - b[1][k]).abs().max()) for k in a[1]))
        for a, b in zip(results[False], results[True], strict=True)
    )
    out["many_runs"] = [o.metrics.get("lora_pass_runs:max", 1.0) for o in outcomes]
    return out


def _max(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_float64_layouts_merge_and_passes(pool4, roots, tmp_path):
    parts = pool4.run(float64_case, root=roots, export=str(tmp_path / "export"))
    runs = {k: v for part in parts for k, v in part.items() if isinstance(k, tuple)}
    assert set(runs) == {(dp, cp) for dp, cp, _, _ in LAYOUTS} | set(EP_LAYOUTS)
    for ep in {ep for _, _, ep in EP_LAYOUTS}:
        for what in ("snapshot", "export"):  # the sampler's / the merged export's log-probs = the run's forward
            worst = max(part[f"EP{ep} {what}"] for part in parts if f"EP{ep} {what}" in part)
            print(f"\nLoRA under EP{ep}: {what} vs the run's forward: {worst:.1e}")
            assert worst <= 1e-10, (ep, what, worst)
    ref_loss, ref_out, ref_grads, ref_weights = runs[1, 1]
    expert_grads = [g for n, g in ref_grads.items() if "mlp-experts" in n]
    assert len(expert_grads) == 2 * 3 * 4 and all(float(g.abs().max()) > 0 for g in expert_grads)
    for key, (loss, outputs, grads, weights) in runs.items():
        assert abs(loss - ref_loss) <= 1e-10 * max(1.0, abs(ref_loss)), key
        for got, want in zip(outputs, ref_out, strict=True):
            assert _max(got, want) <= 1e-10, key
        assert _max(grads, ref_grads) <= 1e-10, key
        assert _max(weights, ref_weights) <= 1e-10, key
    for part in parts:
        assert part["merged"] <= 1e-10  # float64: merged expert tensors compute the adapted function
        assert part["decode_base"]  # an expert run's snapshot decodes alone
        assert part["many"] <= 1e-12  # it ran alone inside forward_backward_many: the very same computation
    assert parts[0]["many_runs"] == [1.0, 1.0]  # neither shared a pass


@pytest.mark.parametrize("ep", [1, 2])
def test_lora_on_moe_through_the_sdk(tmp_path, ep):
    """``ringtune serve --cp 2 [--ep 2]`` (float64) on a tiny Qwen3.5-MoE: a LoRA run with the default targets
    (routed experts, shared expert, attention, unembedding) steps as a single-process trainer does while a run
    without expert adapters steps beside it (the two never share a pass); its sampler's greedy tokens and
    log-probs are the run's forward; its PEFT export gives the server's log-probs in transformers + peft. Under
    EP the shared base's experts are split over the two ranks, the adapters whole."""
    import tinker
    from gateway_fixtures import tiny_model_dir
    from test_gateway_workers import ADAM, engine_datums, sdk_datums
    from test_lora_service import peft_logprobs

    from ringtune.gateway.serve_process import ServeProcess

    model_dir = tiny_model_dir(tmp_path / "model")  # the 96-word tokenizer ...
    hf_model("qwen3_5_moe", seed=3).save_pretrained(model_dir)  # ... with a Qwen3.5-MoE in place of the model
    args = ["--cp", "2", "--ep", str(ep), "--dtype", "float64", "--max-tokens-per-rank", "64", "--lora-pass-runs", "8"]
    proc = ServeProcess(
        str(model_dir),
        checkpoint_root=tmp_path / "ckpt",
        log_path=tmp_path / "serve.log",
        api_key="tml-moe-lora",
        extra_args=args,
    )
    base = str(model_dir)
    specs = (LoraSpec(rank=RANK, seed=3), LoraSpec(rank=2, seed=4, train_mlp=False))
    direct = [
        LoraTrainer(LoraModel(load_hf(base, dtype=torch.float64), s), None, max_tokens_per_rank=64) for s in specs
    ]
    adam = tinker.AdamParams(learning_rate=1e-2, eps=1e-8)  # = test_gateway_workers.ADAM
    with proc, tinker.ServiceClient(base_url=proc.url, api_key="tml-moe-lora") as sc:
        clients = [
            sc.create_lora_training_client(base, rank=s.rank, seed=s.seed, train_mlp=s.train_mlp).result()
            for s in specs
        ]
        for step in range(2):
            futures = [c.forward_backward(sdk_datums(step + 3 * i), "cross_entropy") for i, c in enumerate(clients)]
            for i, (client, future, trainer) in enumerate(zip(clients, futures, direct, strict=True)):
                got = future.result().metrics["loss:sum"]
                want = trainer.forward_backward(engine_datums(sdk_datums(step + 3 * i)), "cross_entropy")
                assert abs(got - want.metrics["loss:sum"]) <= 1e-9 * max(1.0, abs(got)), (step, i)
                norm = client.optim_step(adam).result().metrics["grad_norm:mean"]
                assert abs(norm - trainer.optim_step(ADAM)["grad_norm:mean"]) <= 1e-9 * norm and norm > 0
        tc = clients[0]
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = tinker.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
        prompts = [[1, 2, 3], [7, 8]]
        futures = [sampler.sample(tinker.ModelInput.from_ints(p), 1, params) for p in prompts]  # one decode batch
        for prompt, future in zip(prompts, futures, strict=True):
            seq = future.result(timeout=120).sequences[0]
            full = [*prompt, *seq.tokens]
            datum = tinker.Datum(
                model_input=tinker.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
            )
            lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
            assert torch.allclose(torch.tensor(seq.logprobs), lp[len(prompt) - 1 :].float(), atol=1e-5), prompt
        tc.save_weights_for_sampler("moe-export").result()
        export = tmp_path / "ckpt" / tc.model_id / "sampler_weights" / "moe-export"
        peft_lp = peft_logprobs(model_dir, export, full)
        print(f"\nMoE LoRA, EP {ep}: PEFT export vs server log-probs: {float((peft_lp - lp.float()).abs().max()):.1e}")
        assert float((peft_lp - lp.float()).abs().max()) <= 1e-4
