"""A LoRA run's sampler snapshot on the shared base (ringtune.models.lora_snapshot) and the pool's accounting.

float64, tiny Qwen3.5 hybrid (GatedDeltaNet and full attention decode paths), every target group: the
snapshot's greedy tokens, sample log-probs and prompt log-probs equal the merged model's (the HF export's
weights) and the run's own training forward; the snapshot keeps the adapters of the moment it was taken
while the run steps on; it costs the adapters only; the pool holds many adapter snapshots beside its weight
copies, without counting them against ``max_snapshots``.
"""

from __future__ import annotations

import pytest
import torch
from support.lora import randomize_adapters
from support.tiny_models import hf_model

from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.layout import zigzag_slice
from ringtune.models.lora import LoraModel, LoraSpec
from ringtune.models.lora_merge import merged_model
from ringtune.models.lora_snapshot import LoraSnapshot
from ringtune.models.shard import shard_of
from ringtune.sample import SamplingParams, generate
from ringtune.sample.pool import SamplerPool, SamplerSource

PROMPTS = [[3, 17, 42, 8, 5], [9], [11, 2, 60, 61, 7, 7, 1, 30]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop=[])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> LoraTrainer:
    from ringtune.models.checkpoints.hf import load_hf

    path = tmp_path_factory.mktemp("lora-snapshot") / "qwen3_5"
    hf_model("qwen3_5", seed=21).save_pretrained(path)
    base = load_hf(path, dtype=torch.float64)
    lora = LoraModel(base, LoraSpec(rank=4, seed=3))
    randomize_adapters(lora, seed=5)
    return LoraTrainer(lora, None, max_tokens_per_rank=256)


def forward_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """The training forward's log p(tokens[i+1] | tokens[:i+1]) of one sequence."""
    ids = torch.tensor(tokens)
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    shard = shard_of([len(tokens)])
    with torch.no_grad():
        lp = model.label_logprobs(
            zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard
        )
    return lp[: len(tokens) - 1]


def test_snapshot_samples_like_the_merged_model_and_the_training_forward(trainer):
    snapshot = trainer.sampler_snapshot()
    assert isinstance(snapshot, LoraSnapshot) and snapshot.base is trainer.lora.base
    merged = merged_model(trainer.lora)
    ours = generate(snapshot, PROMPTS, GREEDY, prompt_logprobs=True)
    theirs = generate(merged, PROMPTS, GREEDY, prompt_logprobs=True)
    for prompt, a, b in zip(PROMPTS, ours, theirs, strict=True):
        seq, ref = a.sequences[0], b.sequences[0]
        assert seq.tokens == ref.tokens
        assert max(abs(x - y) for x, y in zip(seq.logprobs, ref.logprobs, strict=True)) <= 1e-10
        got = [x for x in a.prompt_logprobs[1:]]
        assert max((abs(x - y) for x, y in zip(got, b.prompt_logprobs[1:], strict=True)), default=0.0) <= 1e-10
        train = forward_logprobs(trainer.lora, prompt + seq.tokens)  # the run's own forward of the sequence
        assert (train[len(prompt) - 1 :] - torch.tensor(seq.logprobs, dtype=torch.float64)).abs().max() <= 1e-10


def test_snapshot_keeps_its_adapters_and_costs_only_them(trainer):
    snapshot = trainer.sampler_snapshot()
    before = generate(snapshot, PROMPTS, GREEDY)
    data = [
        TrainDatum(
            tokens=torch.tensor(p), inputs={"target_tokens": torch.tensor([*p[1:], 1]), "weights": torch.ones(len(p))}
        )
        for p in PROMPTS
    ]
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=0.5))
    after_step = generate(snapshot, PROMPTS, GREEDY)
    assert [r.sequences[0].logprobs for r in after_step] == [r.sequences[0].logprobs for r in before]
    fresh = generate(trainer.sampler_snapshot(), PROMPTS, GREEDY)
    assert [r.sequences[0].logprobs for r in fresh] != [r.sequences[0].logprobs for r in before]
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.lora.base.parameters())
    assert snapshot.adapter_bytes() == sum(p.numel() * p.element_size() for p in trainer.lora.parameters())
    assert snapshot.adapter_bytes() < model_bytes / 4


def test_pool_holds_adapter_snapshots_beside_its_weight_copies(trainer):
    base = trainer.lora.base
    pool = SamplerPool(lambda path: merged_model(trainer.lora), max_snapshots=1, max_adapter_snapshots=3)
    runs = {}
    for i in range(4):
        lora = LoraModel(base, LoraSpec(rank=2, seed=i))
        runs[f"r{i}"] = LoraTrainer(lora, None, max_tokens_per_rank=64)
    pool.create("base", SamplerSource(), runs)  # one weight copy (the loader's)
    for i in range(3):
        pool.create(f"s{i}", SamplerSource(run_id=f"r{i}"), runs)
    assert len(pool.snapshots) == 4  # 1 weight copy + 3 adapter snapshots: none evicted
    assert pool.model("base") is not None
    pool.create("s3", SamplerSource(run_id="r3"), runs)  # a 4th adapter snapshot evicts the oldest one
    assert sum(isinstance(m, LoraSnapshot) for m in pool.snapshots.values()) == 3
    with pytest.raises(Exception, match="evicted"):
        pool.model("s0")
