"""Expert parallelism: every (DP, CP, EP) layout that fits in 4 ranks equals the one-rank model in float64.

Each layout runs the same two packed rows (DP ranks split the rows, CP ranks the tokens, EP ranks the
experts); gradients are reduced by :class:`GradientInvariant` (non-expert over DP×CP, experts over the expert
replica group, both canaries checked), then one AdamW step. Log-probs, gradients (an expert's against the
reference's same expert) and post-step weights must equal the one-rank run within 1e-12 (summation order
is all that differs). Also: the expert memory per rank, the dispatch bytes against the minimum the routing
allows, and the invariant catching expert gradients reduced over the wrong group.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
from support.tiny_models import LENGTHS, hf_model, next_token_labels, packed_tokens

from ringtune.debug_faults import FaultHooks
from ringtune.engine.gradients import GradientInvariant, GradientInvariantError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.layers.moe import is_expert_parameter, moe_blocks, set_expert_parallel
from ringtune.models.recompute import set_recompute
from ringtune.models.shard import shard_of

pytest.importorskip("transformers")

ROWS = (LENGTHS, (2, 3, 17, 30))
# (DP, CP, EP, attention, gated_delta, recompute): the six layouts, modes and recomputation varied.
LAYOUTS = [
    (1, 1, 1, "ring", "headwise", "none"),
    (1, 2, 2, "ring", "chunkwise", "none"),
    (2, 1, 2, "ring", "headwise", "full"),
    (1, 4, 4, "allgather", "headwise", "none"),
    (2, 2, 4, "alltoall", "chunkwise", "selective"),
    (1, 4, 2, "ring", "chunkwise", "full"),
]
LR = 1e-2


def _step(model, rows, shards, invariant: GradientInvariant) -> list[torch.Tensor]:
    """Forward/backward every (row, shard), reduce (checked), one AdamW step; returns each row's local log-probs."""
    out = []
    for lens, shard in zip(rows, shards, strict=True):
        ids = packed_tokens(lens, model.config.vocab_size, seed=sum(lens))
        labels = next_token_labels(ids, lens)
        weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(len(lens)), dtype=torch.float64)
        local_labels = zigzag_slice(labels, shard.plan, pad_value=-100)
        local = model.label_logprobs(zigzag_slice(ids, shard.plan), local_labels, shard)
        ((local * zigzag_slice(weights, shard.plan)).sum() + invariant.loss_term()).backward()
        out.append(local.detach())
    invariant.count(len(rows))
    named = [(n, p) for n, p in model.named_parameters()]
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    invariant.reduce_and_check(
        [p.grad for n, p in named if not is_expert_parameter(n)], [p.grad for n, p in named if is_expert_parameter(n)]
    )
    return out


def layouts_case(ctx, *, family: str, root: str) -> dict[str, tuple[float, float, float]]:
    """On every rank: the one-rank reference, then each layout of LAYOUTS; worst errors per layout."""
    base = load_hf(pathlib.Path(root) / family, dtype=torch.float64)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_shards = [shard_of(lens) for lens in ROWS]
    ref_lp = _step(ref, ROWS, ref_shards, GradientInvariant(lambda: None, expert_group=lambda: None))
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_opt.step()
    ref_rows = []
    for lens, shard, lp in zip(ROWS, ref_shards, ref_lp, strict=True):
        row = torch.zeros(sum(lens), dtype=torch.float64)
        row[shard.plan.row_index[shard.plan.is_real]] = lp[shard.plan.is_real]
        ref_rows.append(row)
    out = {}
    for dp, cp, ep, attention, gated_delta, recompute in LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp, ep=ep)
        model = copy.deepcopy(base)
        set_expert_parallel(model, mesh.ep_group)
        set_recompute(model, recompute)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        rows = ROWS[mesh.dp_rank :: dp]
        modes = {"attention": attention, "gated_delta": gated_delta, "pad_multiplier": 4}
        shards = [shard_of(r, cp_size=cp, cp_rank=mesh.cp_rank, group=mesh.cp_group, **modes) for r in rows]
        invariant = GradientInvariant(lambda m=mesh: m.dp_cp_group, expert_group=lambda m=mesh: m.expert_replica_group)
        lps = _step(model, rows, shards, invariant)
        lp_err = 0.0
        for lens, shard, lp in zip(rows, shards, lps, strict=True):
            real = shard.plan.is_real
            want = ref_rows[ROWS.index(lens)][shard.plan.row_index[real]]
            lp_err = max(lp_err, float((lp[real] - want).abs().max()))
        opt.step()
        grad_err = weight_err = 0.0
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            rows_of = slice(None)
            if is_expert_parameter(name):
                experts = model.get_submodule(name.rsplit(".", 1)[0])
                rows_of = slice(experts.first, experts.first + experts.num_local)
            grad_err = max(grad_err, float((p.grad - ref_grads[name][rows_of]).abs().max()))
            weight_err = max(weight_err, float((p.detach() - ref_params[name].detach()[rows_of]).abs().max()))
        out[f"DP{dp} CP{cp} EP{ep} {attention}/{gated_delta} recompute={recompute}"] = (lp_err, grad_err, weight_err)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("moe_ep")
    for family in ("qwen3_moe", "qwen3_5_moe"):
        hf_model(family, seed=11).save_pretrained(root / family)
    return root


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_layouts_equal_one_rank_float64(pool4, checkpoints, family):
    per_rank = pool4.run(layouts_case, family=family, root=str(checkpoints))
    print(f"\n{family} float64 layout vs one rank (max |d logprob|, max |d grad|, max |d weight| after AdamW):")
    for key in per_rank[0]:
        worst = [max(r[key][i] for r in per_rank) for i in range(3)]
        print(f"  {key}: {worst[0]:.1e} {worst[1]:.1e} {worst[2]:.1e}")
        assert max(worst) < 1e-12, (key, worst)


def ep_accounting_case(ctx, *, root: str) -> dict[str, float]:
    """EP=4 over one CP=4 row: expert bytes per rank vs EP=1, dispatch bytes vs the routing, wrong-group check."""
    from ringtune.parallel.meter import measure_comm

    base = load_hf(pathlib.Path(root) / "qwen3_5_moe", dtype=torch.float64)
    mesh = ctx.mesh(dp=1, cp=4, ep=4)
    model = copy.deepcopy(base)
    set_expert_parallel(model, mesh.ep_group)

    def expert_bytes(m) -> int:
        return sum(p.numel() * p.element_size() for n, p in m.named_parameters() if is_expert_parameter(n))

    chosen: list[torch.Tensor] = []
    hooks = [b.gate.register_forward_hook(lambda mod, a, out: chosen.append(out[1])) for b in moe_blocks(model)]
    shard = shard_of(LENGTHS, cp_size=4, cp_rank=mesh.cp_rank, group=mesh.cp_group, gated_delta="chunkwise")
    ids = zigzag_slice(packed_tokens(LENGTHS, 96, seed=1), shard.plan)
    with measure_comm() as meter:
        model.label_logprobs(ids, torch.full_like(ids, -100), shard)
    for h in hooks:
        h.remove()
    hidden, owner = model.config.hidden_size, torch.div(torch.cat(chosen), 2, rounding_mode="floor")  # 8 experts / 4
    remote = owner != mesh.ep_rank
    copies = int(remote.sum())  # (token, expert) assignments whose expert is on another rank
    distinct = sum(len(set(row[row != mesh.ep_rank].tolist())) for row in owner)  # remote ranks per token
    sent = meter.by_op.get("expert_dispatch", 0) + meter.by_op.get("expert_combine", 0)
    invariant = GradientInvariant(
        lambda: mesh.dp_cp_group,
        expert_group=lambda: mesh.expert_replica_group,
        faults=FaultHooks(name="experts_over_dp_cp"),
    )
    invariant.loss_term().backward()  # one microbatch's canary
    invariant.count(1)
    try:
        invariant.reduce_and_check([], [])
        caught = ""
    except GradientInvariantError as exc:
        caught = str(exc)
    import torch.distributed as dist

    from ringtune.errors import ParallelConfigError
    from ringtune.parallel.mesh import build_mesh

    groups = {}
    for dp, cp, ep in ((2, 2, 4), (1, 4, 2), (2, 2, 2), (2, 1, 2)):
        m = ctx.mesh(dp=dp, cp=cp, ep=ep)
        groups[dp, cp, ep] = (
            dist.get_process_group_ranks(m.ep_group),
            dist.get_process_group_ranks(m.expert_replica_group),
        )
    try:
        build_mesh(dp=1, cp=4, ep=3)
        mesh_refused = ""
    except ParallelConfigError as exc:
        mesh_refused = str(exc)
    return {
        "groups": groups,
        "mesh_refused": mesh_refused,
        "memory_ratio": expert_bytes(model) / expert_bytes(base),
        "sent": sent,
        "routes": meter.by_op.get("expert_routes", 0),
        "expected_routes": copies * (8 + 8),  # one int64 route and one float64 weight per remote assignment
        "minimum": 2 * distinct * hidden * 8,
        "tokens": ids.numel() * len(chosen),
        "caught": caught,
    }


def test_expert_memory_dispatch_bytes_and_wrong_group(pool4, checkpoints):
    per_rank = pool4.run(ep_accounting_case, root=str(checkpoints))
    sent = sum(r["sent"] for r in per_rank)
    minimum = sum(r["minimum"] for r in per_rank)
    tokens = sum(r["tokens"] for r in per_rank)
    print(
        f"\nEP4: expert bytes per rank / EP1 = {per_rank[0]['memory_ratio']:.3f}; forward dispatch+combine "
        f"{sent / tokens:.0f} B per token-layer vs minimum {minimum / tokens:.0f} (ratio {sent / minimum:.3f}), "
        f"routes {sum(r['routes'] for r in per_rank) / tokens:.0f} B"
    )
    # Over the group: one row per remote (token, rank) pair, there and back (a rank sends back what it got).
    assert sent == minimum
    assert sum(r["routes"] for r in per_rank) == sum(r["expected_routes"] for r in per_rank)
    # EP groups: consecutive DP×CP indices (l = dp_rank·cp + cp_rank); expert replicas: same l % ep. DP2×CP1 is
    # two meshes side by side in the pool of 4 (ranks 0-1 and 2-3), each with one replica per expert.
    want = {
        (2, 2, 4): ([[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
        (1, 4, 2): ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (2, 2, 2): ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (2, 1, 2): ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0], [1], [2], [3]]),
    }
    for rank, r in enumerate(per_rank):
        for layout, (ep_groups, replica_groups) in want.items():
            assert r["groups"][layout] == (ep_groups[rank], replica_groups[rank]), (rank, layout, r["groups"][layout])
        assert "ep=3 must divide dp·cp = 1·4 = 4" in r["mesh_refused"]
    for r in per_rank:
        assert r["memory_ratio"] == 0.25
        assert "expert replicas" in r["caught"]


TRAINER_LAYOUTS = ((2, 2, 4), (2, 1, 2), (2, 2, 2))  # (2, 2, 2): two expert replicas across DP (it once hung)


def trainer_case(ctx, *, root: str, out: str) -> dict[str, float]:
    """The Trainer at EP layouts against the one-process Trainer: loss, log-probs, grad norm, post-step weights."""
    from ringtune.engine.optimizer import AdamParams
    from ringtune.engine.trainer import Trainer
    from ringtune.models.layers.moe import gather_expert_state

    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0)
    path = pathlib.Path(root) / "qwen3_5_moe"
    data = _datums(96)
    ref = Trainer(load_hf(path, dtype=torch.float64), None, max_tokens_per_rank=64)
    want = ref.forward_backward(data, "cross_entropy")
    want_norm = ref.optim_step(adam)["grad_norm:mean"]
    ref_weights = ref.model.state_dict()
    out_errors = {}
    for dp, cp, ep in TRAINER_LAYOUTS:
        mesh = ctx.mesh(dp=dp, cp=cp, ep=ep)
        trainer = Trainer(load_hf(path, dtype=torch.float64), mesh, max_tokens_per_rank=64, gated_delta="chunkwise")
        got = trainer.forward_backward(data, "cross_entropy")
        norm = trainer.optim_step(adam)["grad_norm:mean"]
        weights = gather_expert_state(trainer.model)
        errors = [abs(norm - want_norm), max(float((weights[n] - t).abs().max()) for n, t in ref_weights.items())]
        if trainer.is_result_rank:
            errors.append(abs(got.metrics["loss:sum"] - want.metrics["loss:sum"]))
            for a, b in zip(got.outputs, want.outputs, strict=True):
                errors.append(float((a["logprobs"] - b["logprobs"]).abs().max()))
        out_errors[f"DP{dp} CP{cp} EP{ep}"] = max(errors)
    trainer.export_hf(out)  # the last layout's weights, experts gathered
    return out_errors


def trainer_checkpoint_case(ctx, *, root: str, ckpt: str) -> dict[str, float]:
    """save_state at DP1×CP4×EP2 after one step, two more steps; load_state and the same two steps again must be
    bit-exact; the checkpoint loads at EP4 and into the one-process Trainer with every expert exactly as saved."""
    from ringtune.engine.optimizer import AdamParams
    from ringtune.engine.trainer import Trainer
    from ringtune.models.layers.moe import gather_expert_state

    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0)
    path = pathlib.Path(root) / "qwen3_5_moe"
    data = _datums(96)

    def steps(trainer, n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        figures = []
        for _ in range(n):
            loss = trainer.forward_backward(data, "cross_entropy").metrics.get("loss:sum", 0.0)
            figures.append(loss if ctx.rank == 0 else 0.0)  # the loss is returned on the result rank only
            figures.append(trainer.optim_step(adam)["grad_norm:mean"])
        return figures, {n: t.clone() for n, t in gather_expert_state(trainer.model).items()}  # not live views

    def build(ep: int | None) -> Trainer:
        mesh = None if ep is None else ctx.mesh(dp=1, cp=4, ep=ep)
        return Trainer(load_hf(path, dtype=torch.float64), mesh, max_tokens_per_rank=64, gated_delta="chunkwise")

    trainer = build(2)
    _, saved = steps(trainer, 1)
    trainer.save_state(ckpt)
    went_on, after = steps(trainer, 2)
    trainer.load_state(ckpt)
    again, after_again = steps(trainer, 2)
    out = {
        "resumed figures differ": float(went_on != again),
        "resumed weights differ": float(any(not torch.equal(after[n], t) for n, t in after_again.items())),
    }
    for name, other in (("EP4", build(4)), ("one process", build(None))):
        other.load_state(ckpt)
        loaded = gather_expert_state(other.model)
        out[f"{name} load differs"] = float(any(not torch.equal(saved[n], t) for n, t in loaded.items()))
        figures, stepped = steps(other, 2)
        diffs = [abs(a - b) for a, b in zip(figures, went_on, strict=True)]
        out[f"{name} steps after load"] = max(diffs + [float((stepped[n] - t).abs().max()) for n, t in after.items()])
    return out


def _datums(vocab: int):
    from ringtune.engine.batch import TrainDatum

    gen = torch.Generator().manual_seed(7)
    data = []
    for n in (2, 17, 5, 40, 3, 9, 2, 13):
        inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
        inputs["weights"] = torch.randn(n, generator=gen, dtype=torch.float64)
        data.append(TrainDatum(tokens=torch.randint(0, vocab, (n,), generator=gen), inputs=inputs))
    return data


def test_trainer_under_ep_equals_one_process(pool4, checkpoints, tmp_path):
    per_rank = pool4.run(trainer_case, root=str(checkpoints), out=str(tmp_path / "export"))
    for key in per_rank[0]:
        worst = max(r[key] for r in per_rank)
        print(f"\nTrainer {key} vs one process (loss, log-probs, grad norm, post-step weights): {worst:.1e}")
        assert worst < 1e-12, (key, worst)
    exported = load_hf(tmp_path / "export", dtype=torch.float64)  # every expert, written by rank 0
    assert exported.model.layers[0].mlp.experts.num_local == 8


def test_trainer_state_checkpoint_under_ep(pool4, checkpoints, tmp_path):
    """DCP save_state / load_state at DP1×CP4×EP2 (two expert replicas: each expert written once): resuming is
    bit-exact; the same checkpoint loads exactly at EP4 and at EP1 (one process), whose next steps then differ
    from the EP2 run by summation order only (float64, < 1e-12)."""
    per_rank = pool4.run(trainer_checkpoint_case, root=str(checkpoints), ckpt=str(tmp_path / "ep2-state"))
    for key in per_rank[0]:
        worst = max(r[key] for r in per_rank)
        print(f"\nEP checkpoint: {key}: {worst:.1e}")
        assert worst < (1e-12 if key.endswith("after load") else 0.5), (key, worst)


@pytest.mark.parametrize("shard", ["none", "dp_cp"])
def test_serve_cp2_ep2_fine_tunes_through_the_sdk(tmp_path, shard):
    """``ringtune serve --cp 2 --ep 2`` on a tiny Qwen3.5-MoE, replicated and with ``--shard-params dp_cp`` (each
    rank's experts FSDP-sharded over their replicas, here 1, the rest over DP×CP): SDK fine-tune steps lower the
    held-out NLL, the sampler (experts gathered into its snapshot) answers, and save_state / load_state go
    through."""
    import tinker
    from gateway_fixtures import tiny_model_dir

    from ringtune.gateway.serve_process import ServeProcess

    model_dir = tiny_model_dir(tmp_path / "model")  # the 96-word tokenizer ...
    hf_model("qwen3_5_moe", seed=3).save_pretrained(model_dir)  # ... with a Qwen3.5-MoE in place of the model
    args = ["--cp", "2", "--ep", "2", "--max-tokens-per-rank", "64", "--max-restarts", "0", "--shard-params", shard]
    proc = ServeProcess(
        str(model_dir),
        checkpoint_root=tmp_path / "ckpt",
        log_path=tmp_path / "serve.log",
        api_key="tml-moe",
        extra_args=args,
    )
    gen = torch.Generator().manual_seed(0)
    pattern = [int(t) for t in torch.randint(0, 90, (12,), generator=gen)]

    def datum(shift: int):
        tokens = pattern[shift:] + pattern[:shift]  # one repeated pattern: learnable in a few steps
        return tinker.Datum(
            model_input=tinker.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11},
        )

    train, held_out = [datum(s) for s in range(0, 12, 2)], [datum(s) for s in range(1, 12, 4)]
    with proc, tinker.ServiceClient(base_url=proc.url, api_key="tml-moe") as sc:
        tc = sc.create_lora_training_client(str(model_dir), rank=0).result()

        def nll() -> float:
            m = tc.forward(held_out, "cross_entropy").result().metrics
            return m["loss:sum"] / 33

        before = nll()
        for _ in range(4):
            metrics = tc.forward_backward(train, "cross_entropy").result().metrics
            tc.optim_step(tinker.AdamParams(learning_rate=3e-2)).result()
        assert metrics["moe/layer0/load_max_over_mean:max"] >= 1.0  # per-layer expert load through the SDK
        after = nll()
        print(f"\nserve --cp 2 --ep 2 --shard-params {shard}: held-out NLL {before:.3f} -> {after:.3f} nats per token")
        assert after < before - 0.1
        sampler = tc.save_weights_and_get_sampling_client().result()
        seq = sampler.sample(
            tinker.ModelInput.from_ints(pattern[:4]), 1, tinker.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
        )
        assert len(seq.result(timeout=120).sequences[0].tokens) == 4
        saved = tc.save_state("ep2").result()  # DCP under EP: each expert once (docs/moe.md)
        tc.load_state(saved.path).result()


FSDP_LAYOUTS = ((1, 2, 2), (2, 2, 2), (1, 4, 2), (1, 4, 4), (2, 2, 4))


def fsdp_case(ctx, *, root: str, ckpt: str, out: str) -> dict[str, float]:
    """``shard_params='dp_cp'`` under EP (experts sharded over their replica group, the rest over DP×CP) against
    the one-process Trainer: loss, log-probs, grad norm, post-step weights over two steps; its DCP checkpoint
    resumes bit-exactly and loads exactly into the replicated EP 2 and the one-process trainers; its HF export."""
    from ringtune.engine.optimizer import AdamParams
    from ringtune.engine.sharding import full_state_dict
    from ringtune.engine.trainer import Trainer
    from ringtune.errors import ParallelConfigError
    from ringtune.models.layers.moe import gather_expert_state

    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
    path = pathlib.Path(root) / "qwen3_5_moe"
    data = _datums(96)

    def whole(trainer) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in gather_expert_state(trainer.model, full_state_dict(trainer.model)).items()}

    def steps(trainer, n: int) -> tuple[list, dict[str, torch.Tensor]]:
        """Per step: the grad norm, then on the result rank the loss and every log-prob; the weights after."""
        figures = []
        for _ in range(n):
            got = trainer.forward_backward(data, "cross_entropy")
            figures.append(trainer.optim_step(adam)["grad_norm:mean"])
            if trainer.is_result_rank:
                figures.append(got.metrics["loss:sum"])
                figures += [lp for o in got.outputs for lp in o["logprobs"].tolist()]
        return figures, whole(trainer)

    def build(dp: int, cp: int, ep: int, shard: str = "dp_cp") -> Trainer:
        mesh = ctx.mesh(dp=dp, cp=cp, ep=ep)
        model = load_hf(path, dtype=torch.float64)
        return Trainer(model, mesh, max_tokens_per_rank=64, gated_delta="chunkwise", shard_params=shard)

    ref = Trainer(load_hf(path, dtype=torch.float64), None, max_tokens_per_rank=64)
    want, want_weights = steps(ref, 2)
    errors: dict[str, float] = {}
    for dp, cp, ep in FSDP_LAYOUTS:
        trainer = build(dp, cp, ep)
        experts = trainer.model.model.layers[0].mlp.experts.gate_up_proj
        shard = experts.to_local().shape[0]  # experts held here: E / (DP·CP)
        figures, weights = steps(trainer, 2)
        mine = want if trainer.is_result_rank else [want[0], want[len(want) // 2]]  # the two grad norms
        diffs = [abs(a - b) for a, b in zip(figures, mine, strict=True)]
        diffs += [float((weights[n] - t).abs().max()) for n, t in want_weights.items()]
        errors[f"DP{dp} CP{cp} EP{ep} dp_cp vs one process"] = max(diffs)
        errors[f"DP{dp} CP{cp} EP{ep} experts per rank x DP·CP"] = float(shard * dp * cp)
    trainer = build(1, 4, 2)
    steps(trainer, 1)
    trainer.save_state(ckpt)
    saved = whole(trainer)
    went_on, after = steps(trainer, 2)
    trainer.load_state(ckpt)
    again, after_again = steps(trainer, 2)
    moved = any(not torch.equal(after[n], t) for n, t in after_again.items())
    errors["resumed differs"] = float(went_on != again or moved)
    trainer.export_hf(out)
    for name, other in (("EP2 replicated", build(1, 4, 2, "none")), ("EP4 dp_cp", build(1, 4, 4))):
        other.load_state(ckpt)
        errors[f"{name} load differs"] = float(any(not torch.equal(saved[n], t) for n, t in whole(other).items()))
    one = Trainer(load_hf(path, dtype=torch.float64), None, max_tokens_per_rank=64)
    one.load_state(ckpt)
    loaded = one.model.state_dict()
    errors["one process load differs"] = float(any(not torch.equal(saved[n], t) for n, t in loaded.items()))
    # bf16-mixed (float32 masters, bfloat16 layers) with dp_cp under EP against the one-process bf16-mixed Trainer
    mixed = {}
    for name, mesh in (("one process", None), ("DP1 CP4 EP2 dp_cp", ctx.mesh(dp=1, cp=4, ep=2))):
        shard = "none" if mesh is None else "dp_cp"
        t = Trainer(load_hf(path, dtype=torch.float32), mesh, max_tokens_per_rank=64, gated_delta="chunkwise",
                    shard_params=shard, compute_dtype=torch.bfloat16)  # fmt: skip
        first = t.forward_backward(data, "cross_entropy").metrics.get("loss:sum", 0.0)
        norm = t.optim_step(adam)["grad_norm:mean"]
        second = t.forward_backward(data, "cross_entropy").metrics.get("loss:sum", 0.0)
        mixed[name] = (first, norm, second)
    (a1, an, a2), (b1, bn, b2) = mixed.values()
    errors["bf16-mixed grad norm rel"] = abs(an - bn) / an
    if ctx.rank == 0:  # losses on the result rank
        errors["bf16-mixed loss rel"] = max(abs(a1 - b1) / abs(a1), abs(a2 - b2) / abs(a2))
    try:
        build(1, 4, 2, "dp")
        errors["dp refused"] = 0.0
    except ParallelConfigError as exc:
        errors["dp refused"] = float("dp_cp" in str(exc))
    return errors


def test_fsdp_under_ep_equals_one_process(pool4, checkpoints, tmp_path):
    per_rank = pool4.run(fsdp_case, root=str(checkpoints), ckpt=str(tmp_path / "fsdp-ep"), out=str(tmp_path / "hf"))
    for key in {k: None for r in per_rank for k in r}:
        worst = max(r.get(key, 0.0) for r in per_rank)
        print(f"\nFSDP under EP: {key}: {worst:.1e}")
        if key.endswith("x DP·CP"):
            assert worst == 8, key  # 8 experts: each rank holds 1/(DP·CP) of them
        elif key == "dp refused":
            assert min(r[key] for r in per_rank) == 1.0
        elif key.startswith("bf16-mixed"):
            # bfloat16 layers (8-bit mantissa) sum the experts' and the ranks' terms in another order than one
            # process; the loss after a step also carries the bf16-rounded update. Measured 1.7e-5 (grad norm)
            # and 1.4e-3 (loss); limits ~10x that
            assert worst < (2e-4 if "norm" in key else 1.5e-2), (key, worst)
        else:
            assert worst < (1e-12 if "vs one process" in key else 0.5), (key, worst)
    exported = load_hf(tmp_path / "hf", dtype=torch.float64)
    assert exported.model.layers[0].mlp.experts.num_local == 8


def test_load_reads_only_this_ranks_experts(checkpoints, tmp_path):
    """``load_hf(..., ep=(rank, size))`` reads a rank's experts only: a checkpoint without experts 4-7 loads at
    EP rank 0 of 2 (and equals the whole model's experts 0-3 and every other tensor), while the whole load and
    EP rank 1 name the missing tensors; a fused-layout checkpoint is read as the rank's slice."""
    from safetensors.torch import load_file, save_file

    from ringtune.errors import ParallelConfigError, UserInputError

    src = checkpoints / "qwen3_5_moe"
    whole = load_hf(src, dtype=torch.float64)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not any(f".experts.{e}." in k for e in range(4, 8))}
    assert len(kept) < len(tensors)
    save_file(kept, partial / "model.safetensors")
    half = load_hf(partial, dtype=torch.float64, ep=(0, 2))
    assert half.model.layers[0].mlp.experts.num_local == 4 and half.model.layers[0].mlp.experts.first == 0
    for name, t in half.state_dict().items():
        want = whole.state_dict()[name]
        assert torch.equal(t, want[:4] if is_expert_parameter(name) else want), name
    with pytest.raises(UserInputError, match=r"missing tensors \['model.layers.0.mlp.experts.4.gate_proj"):
        load_hf(partial, dtype=torch.float64)
    with pytest.raises(UserInputError, match=r"missing tensors \['model.layers.0.mlp.experts.down_proj"):
        load_hf(partial, dtype=torch.float64, ep=(1, 2))  # none of its experts there: the fused tensors are missing
    with pytest.raises(ParallelConfigError, match="ep=3 must divide num_experts=8"):
        load_hf(src, ep=(0, 3))
    fused = tmp_path / "fused"  # our in-memory layout written as is: transformers' fused expert tensors
    fused.mkdir()
    (fused / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in whole.state_dict().items()}, fused / "model.safetensors")
    upper = load_hf(fused, dtype=torch.float64, ep=(1, 2))
    for name, t in upper.state_dict().items():
        want = whole.state_dict()[name]
        assert torch.equal(t, want[4:] if is_expert_parameter(name) else want), name


def cut_load_case(ctx, *, root: str) -> dict[str, float]:
    """A Trainer on a model loaded with this rank's experts only equals one on the whole model, cut at setup."""
    from ringtune.engine.optimizer import AdamParams
    from ringtune.engine.trainer import Trainer

    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
    path = pathlib.Path(root) / "qwen3_5_moe"
    mesh = ctx.mesh(dp=1, cp=4, ep=2)
    figures = []
    for model in (load_hf(path, dtype=torch.float64), load_hf(path, dtype=torch.float64, ep=(mesh.ep_rank, 2))):
        trainer = Trainer(model, mesh, max_tokens_per_rank=64, gated_delta="chunkwise")
        loss = trainer.forward_backward(_datums(96), "cross_entropy").metrics.get("loss:sum", 0.0)
        figures.append((loss, trainer.optim_step(adam)["grad_norm:mean"], model.state_dict()))
    (l1, n1, w1), (l2, n2, w2) = figures
    return {
        "loss": abs(l1 - l2),
        "grad norm": abs(n1 - n2),
        "weights": max(float((w1[k] - w2[k]).abs().max()) for k in w1),
    }


def test_trainer_on_a_cut_load_equals_the_whole_load(pool4, checkpoints):
    for result in pool4.run(cut_load_case, root=str(checkpoints)):
        assert result == {"loss": 0.0, "grad norm": 0.0, "weights": 0.0}, result
