"""Routing replay (R3) in the sampler and the trainer, on a tiny Qwen3.5-MoE (float64).

- The sampler records, per sampled sequence, the experts every MoE layer chose for each token it fed
  (prompt + tokens[:-1]): in float64 these are the training forward's own top-k choices, token for token.
- A datum carrying those records trains exactly as without them (replaying the router's own choice changes
  nothing); records that name other experts change the log-probs and still give the router a gradient; rows of
  −1 leave the router to choose; bad records are a user error naming the field before any compute.
- Under CP and EP (DP1×CP2×EP2, DP2×CP2×EP4 on 4 gloo ranks) a request with records equals the one-process
  trainer with the same records (1e-12).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from support.tiny_models import hf_model

from ringtune.engine.batch import TrainDatum
from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.layers.moe import capturing_routing, moe_shape
from ringtune.models.shard import shard_of
from ringtune.sample import SamplingParams, generate

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("r3") / "qwen3_5_moe"
    hf_model("qwen3_5_moe", seed=5).save_pretrained(path)
    return path


def _datum(tokens: list[int], routing: torch.Tensor | None = None) -> TrainDatum:
    inputs = {"target_tokens": torch.tensor([*tokens[1:], 0]), "weights": torch.ones(len(tokens), dtype=torch.float64)}
    return TrainDatum(tokens=torch.tensor(tokens), inputs=inputs, routing=routing)


def test_sampler_records_the_training_forwards_routing_and_replay_is_exact(model_dir):
    model = load_hf(model_dir, dtype=torch.float64)
    layers, k, experts = moe_shape(model)  # type: ignore[misc]
    prompts = [[3, 17, 42, 8, 5], [9], list(range(20, 60))]
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=3, stop=[])
    results = generate(model, prompts, params, num_samples=2, record_routing=True)
    sequences = [(p, s) for p, r in zip(prompts, results, strict=True) for s in r.sequences]
    for prompt, seq in sequences:
        fed = prompt + seq.tokens[:-1]
        assert seq.routing is not None and tuple(seq.routing.shape) == (len(fed), layers, k)
        shard = shard_of([len(fed)])
        with torch.no_grad(), capturing_routing(model) as captured:
            model.hidden_states(zigzag_slice(torch.tensor(fed), shard.plan), shard)
        own = torch.stack([c[0] for c in captured], dim=1)[: len(fed)]
        assert torch.equal(seq.routing.long(), own)  # float64: decode routes exactly as the training forward
    assert generate(model, prompts[:1], params)[0].sequences[0].routing is None  # off unless asked

    data = [_datum(p + s.tokens[:-1]) for p, s in sequences]
    replayed = [_datum(p + s.tokens[:-1], s.routing) for p, s in sequences]
    plain = Trainer(load_hf(model_dir, dtype=torch.float64), None, max_tokens_per_rank=64)
    with_records = Trainer(load_hf(model_dir, dtype=torch.float64), None, max_tokens_per_rank=64)
    a = plain.forward_backward(data, "cross_entropy")
    b = with_records.forward_backward(replayed, "cross_entropy")
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert torch.equal(x["logprobs"], y["logprobs"])
    grads = [(p.grad, q.grad) for p, q in zip(plain.model.parameters(), with_records.model.parameters(), strict=True)]
    assert all(torch.equal(g, h) for g, h in grads if g is not None)

    # Other experts: other log-probs; the router still learns; -1 rows leave a datum to its router.
    fed = sequences[0][0] + sequences[0][1].tokens[:-1]
    other = (torch.arange(len(fed) * layers * k).reshape(len(fed), layers, k) % experts).flip(-1)
    other[:, :, 1] = (other[:, :, 0] + 1) % experts  # k distinct ids per row
    trainer = Trainer(load_hf(model_dir, dtype=torch.float64), None, max_tokens_per_rank=64)
    moved = trainer.forward_backward([_datum(fed, other), _datum(fed, torch.full_like(other, -1))], "cross_entropy")
    assert not torch.allclose(moved.outputs[0]["logprobs"], a.outputs[0]["logprobs"])
    # (packed with another datum here: summation order only)
    assert torch.allclose(moved.outputs[1]["logprobs"], a.outputs[0]["logprobs"], rtol=0, atol=1e-12)
    router = trainer.model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and float(router.grad.abs().max()) > 0

    bad = other.clone()
    bad[0, 0, 0] = experts
    for routing, words in (
        (other[:-1], f"shape \\[{len(fed) - 1}, {layers}, {k}\\]; expected \\[{len(fed)}, {layers}, {k}\\]"),
        (bad, "each \\[token, layer\\] row holds k expert ids in \\[0, 8\\) or k times -1"),
    ):
        with pytest.raises(UserInputError, match=f"data\\[0\\].routing: {words}"):
            trainer.forward_backward([_datum(fed, routing)], "cross_entropy")


def replay_case(ctx, *, root: str) -> dict[str, float]:
    """One request with records (and a datum without) at DP×CP×EP layouts against the one-process trainer."""
    path = pathlib.Path(root)
    gen = torch.Generator().manual_seed(1)
    probe = load_hf(path, dtype=torch.float64)
    layers, k, experts = moe_shape(probe)  # type: ignore[misc]
    data = []
    for n in (5, 17, 2, 30, 9):
        tokens = torch.randint(0, 90, (n,), generator=gen).tolist()
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]).reshape(n, layers, k)
        data.append(_datum(tokens, ids if n != 2 else None))
    want = Trainer(probe, None, max_tokens_per_rank=64).forward_backward(data, "cross_entropy")
    out = {}
    for dp, cp, ep in ((1, 2, 2), (2, 2, 4)):
        trainer = Trainer(load_hf(path, dtype=torch.float64), ctx.mesh(dp=dp, cp=cp, ep=ep), max_tokens_per_rank=64)
        got = trainer.forward_backward(data, "cross_entropy")
        err = 0.0
        if trainer.is_result_rank:
            err = max(
                float((a["logprobs"] - b["logprobs"]).abs().max())
                for a, b in zip(got.outputs, want.outputs, strict=True)
            )
        out[f"DP{dp} CP{cp} EP{ep}"] = err
    return out


def test_replay_under_cp_and_ep_equals_one_process(pool4, model_dir):
    per_rank = pool4.run(replay_case, root=str(model_dir))
    for key in per_rank[0]:
        worst = max(r[key] for r in per_rank)
        print(f"\nrouting replay {key} vs one process: {worst:.1e}")
        assert worst < 1e-12, (key, worst)


def test_served_replay_matches_sampled_sequences(tmp_path):
    """``--routing-replay`` through the gateway and the real SDK (LocalBackend, float32): a datum that is a sampled
    sequence (prompt + tokens[:-1]) gets its recorded routing on every token (``routing_replay_tokens:sum``), and
    the trainer's log-probs of the sampled tokens equal the sampler's; a datum no sample produced gets none."""
    import tinker
    from gateway_fixtures import API_KEY, tiny_model_dir

    from ringtune.gateway.config import GatewayConfig
    from ringtune.gateway.local import LocalBackend
    from ringtune.gateway.server import ServerThread

    model_dir = tiny_model_dir(tmp_path / "model")  # the 96-word tokenizer ...
    hf_model("qwen3_5_moe", seed=5).save_pretrained(model_dir)  # ... with a Qwen3.5-MoE in place of the model
    backend = LocalBackend(str(model_dir), max_tokens_per_rank=128, record_routing=True)
    config = GatewayConfig(checkpoint_root=str(tmp_path / "ckpt"), api_key=API_KEY, routing_replay=True)
    with ServerThread(backend, config) as url, tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(str(model_dir), rank=0).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = [3, 17, 42, 8, 5, 11]
        params = tinker.SamplingParams(max_tokens=9, temperature=1.0, seed=4, stop=[])
        seq = sampler.sample(tinker.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        full = prompt + seq.tokens
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )
        out = tc.forward([datum], "cross_entropy").result()
        assert out.metrics["routing_replay_tokens:sum"] == len(full) - 1
        lp = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1 :]
        assert torch.allclose(lp, torch.tensor(seq.logprobs), atol=1e-4), (lp, seq.logprobs)
        other = tinker.Datum(
            model_input=tinker.ModelInput.from_ints([9, 8, 7, 6]),
            loss_fn_inputs={"target_tokens": [8, 7, 6, 5], "weights": [1.0] * 4},
        )
        assert tc.forward([other], "cross_entropy").result().metrics["routing_replay_tokens:sum"] == 0


def test_routing_records_match_the_longest_prefix_and_stay_bounded():
    from ringtune.gateway.routing_records import RoutingRecords

    records = RoutingRecords(max_tokens=10)
    a = torch.arange(4 * 2 * 2).reshape(4, 2, 2)
    records.add([1, 2, 3, 4], a)
    records.add([1, 2], a[:2] + 100)
    got = records.lookup([1, 2, 3, 4, 5, 6])  # a multi-turn datum: the longest recorded prefix, then -1 rows
    assert got is not None and torch.equal(got[:4], a) and bool((got[4:] == -1).all())
    assert torch.equal(records.lookup([1, 2, 9]), torch.cat([a[:2] + 100, torch.full((1, 2, 2), -1)]))
    assert records.lookup([2, 3]) is None and records.lookup([1, 2, 4, 3])[2:].eq(-1).all()
    # 12 tokens > 10: the least recently used record goes ([1, 2, 3, 4]: [1, 2] was matched since)
    records.add([7] * 6, torch.zeros(6, 2, 2, dtype=torch.int64))
    assert len(records) == 2 and torch.equal(records.lookup([1, 2, 3, 4])[:2], a[:2] + 100)
    with pytest.raises(ValueError, match="3 rows for 2 tokens"):
        records.add([1, 2], a[:3])
