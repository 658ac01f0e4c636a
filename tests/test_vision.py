"""The vision tower, MRoPE positions and VL checkpoints on one process (CP 1; CP 2/4 are test_models_vl_cp.py).

- MRoPE positions per sequence equal transformers' ``get_rope_index`` (and its ``rope_deltas``);
- the positions guard refuses a rank's positions numbered on its shard (pure, no process group);
- a tiny ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` written by
  ``save_pretrained`` loads whole (tower included) and saves back under transformers' names, which
  transformers loads to the same tensors; a VL config over text-only weights still loads, as text;
- float32 log-probs and gradients (language and vision) of rows mixing text and images equal transformers'.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from support.tiny_models import next_token_labels
from support.tiny_vl import IMAGE_TOKEN, hf_vl_logprobs, hf_vl_model, vl_sequences

from ringtune.errors import ParallelConfigError
from ringtune.layout.mrope import check_shard_mrope_positions, sequence_mrope_positions, shard_mrope_positions
from ringtune.layout.zigzag import zigzag_plan, zigzag_slice
from ringtune.models.checkpoints.hf import hf_saved_name, load_hf, save_hf
from ringtune.models.shard import shard_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (directory, transformers model)} of the two VL families, float32, eager attention."""
    root = tmp_path_factory.mktemp("vl_models")
    out = {}
    for family in ("qwen3_5", "qwen3_5_moe"):
        model = hf_vl_model(family, seed=21)
        model.save_pretrained(root / family)
        out[family] = (root / family, model)
    return out


def test_mrope_positions_equal_transformers_get_rope_index(checkpoints):
    hf = checkpoints["qwen3_5"][1]
    for ids, images in vl_sequences(seed=1):
        spans = [(im.token_start, im.grid_thw) for im in images]
        ours, next_position = sequence_mrope_positions(len(ids), spans, 2)
        if not images:
            assert torch.equal(ours, torch.arange(len(ids)).expand(3, -1)) and next_position == len(ids)
            continue
        want, delta = hf.model.get_rope_index(
            ids[None], (ids == IMAGE_TOKEN).int()[None], torch.tensor([im.grid_thw for im in images])
        )
        assert torch.equal(ours, want[:, 0]), (spans, ours, want[:, 0])
        assert next_position - len(ids) == int(delta), spans  # a decode continues at len + rope_deltas


def test_mrope_guard_refuses_positions_numbered_on_the_shard():
    spans = [[(3, (1, 4, 4))], [], [(0, (1, 2, 6))]]
    lens = (20, 7, 15)
    for cp in (2, 4):
        for rank in range(cp):
            plan = zigzag_plan(lens, cp_size=cp, cp_rank=rank, pad_multiplier=4)
            good = shard_mrope_positions(plan, spans, 2)
            check_shard_mrope_positions(good, plan, spans, 2)  # the sequence's numbering, sliced: accepted
            on_shard = plan.positions.clone()
            for start, c in zip(plan.local_starts, plan.chunk_lens, strict=True):
                on_shard[start : start + 2 * c] = torch.arange(2 * c)
            on_shard = torch.where(plan.is_real, on_shard, plan.positions).expand(3, -1)
            with pytest.raises(ParallelConfigError, match="numbered on the shard"):
                check_shard_mrope_positions(on_shard, plan, spans, 2)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_vl_checkpoint_loads_whole_and_saves_transformers_names(checkpoints, tmp_path, family):
    path, hf = checkpoints[family]
    model = load_hf(path)
    assert model.model.visual is not None
    with safe_open(path / "model.safetensors", framework="pt") as f:
        written = set(f.keys())
    save_hf(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert set(saved) == written  # transformers' names, the tower included
    assert any(k.startswith("model.visual.") for k in saved)
    cls = type(hf)
    again = cls.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_vl_config_over_text_weights_loads_as_text(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3_5"]
    with safe_open(path / "model.safetensors", framework="pt") as f:
        text = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("model.visual.")}
    from safetensors.torch import save_file

    (tmp_path / "text").mkdir()
    save_file(text, tmp_path / "text" / "model.safetensors")
    (tmp_path / "text" / "config.json").write_text((path / "config.json").read_text())
    model = load_hf(tmp_path / "text")
    assert model.model.visual is None and model.config.vision is None
    ids, images = vl_sequences(seed=2)[1]
    with pytest.raises(ValueError, match="no vision tower"):
        model.logits(ids, shard_of([len(ids)], images=[images], spatial_merge_size=2))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_float32_logprobs_and_gradients_equal_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    sequences = vl_sequences(seed=4)
    lens = [len(ids) for ids, _ in sequences]
    ids = torch.cat([s for s, _ in sequences])
    labels = next_token_labels(ids, tuple(lens))
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    hf.zero_grad(set_to_none=True)
    want = hf_vl_logprobs(hf, sequences, labels)
    (want.double() * weights).sum().backward()
    model = load_hf(path)
    shard = shard_of(lens, images=[imgs for _, imgs in sequences], spatial_merge_size=2)
    plan = shard.plan  # CP 1: the row with each odd-length sequence padded by one token
    lp = model.label_logprobs(zigzag_slice(ids, plan), zigzag_slice(labels, plan, pad_value=-100), shard)
    real = shard.plan.is_real
    # float32: the same terms summed in different orders (packed vs per-sequence kernels), ~1e-7 per op.
    assert float((lp.detach()[real] - want.detach()[shard.plan.row_index[real]]).abs().max()) < 2e-5
    (lp[real].double() * weights[shard.plan.row_index[real]]).sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        ref = hf_grads[hf_saved_name(name, vision_language=True)].grad
        scale = max(float(ref.abs().max()), 1e-3)
        assert float((p.grad - ref).abs().max()) / scale < 2e-4, name
    assert float(model.model.visual.patch_embed.proj.weight.grad.norm()) > 0


def _last_logits(model, seqs, images):
    """Logits at the last token of every sequence by the training forward over the whole sequences (images too)."""
    shard = shard_of([len(s) for s in seqs], images=images, spatial_merge_size=2)
    flat = zigzag_slice(torch.cat([torch.tensor(s) for s in seqs]), shard.plan)
    hidden = model.hidden_states(flat, shard)
    last = [s + len(q) - 1 for s, q in zip(shard.plan.local_starts, seqs, strict=True)]
    return hidden[last] @ model.output_weight.t()


@torch.inference_mode()
def test_decode_after_images_continues_the_sequence_positions(checkpoints):
    from ringtune.models.batch_cache import DecodeBatch
    from ringtune.sample.prefill import prefill

    model = load_hf(checkpoints["qwen3_5"][0], dtype=torch.float64).eval()
    sequences = vl_sequences(seed=6)
    prompts = [ids.tolist() for ids, _ in sequences]
    images = [imgs for _, imgs in sequences]
    result = prefill(model, prompts, images=images)
    # (1,6,4): 6 tokens advance 3; (1,4,4) 4 by 2, (1,2,8) 4 by 4, (1,4,8) 8 by 4 (rope_deltas, test above)
    assert [c.rope_offset for c in result.caches] == [0, -3, -3, -6, 0]
    batch = DecodeBatch.of(result.caches)
    unshifted = DecodeBatch.of([type(c)(length=c.length, layers=c.layers) for c in result.caches])
    logits, seqs = result.last_logits, [list(p) for p in prompts]
    for _ in range(3):
        assert float((logits - _last_logits(model, seqs, images)).abs().max()) < 1e-10
        nxt = logits.argmax(-1)
        for s, t in zip(seqs, nxt.tolist(), strict=True):
            s.append(t)
        logits = model.decode_hidden(nxt, batch) @ model.output_weight.t()
        wrong = model.decode_hidden(nxt, unshifted) @ model.output_weight.t()
        assert float((wrong - logits)[1:4].abs().max()) > 1e-3  # rotating at the slots would be wrong
    assert float((logits - _last_logits(model, seqs, images)).abs().max()) < 1e-10


@torch.inference_mode()
def test_sampled_logprobs_after_images_equal_the_trainers(checkpoints):
    from ringtune.sample.params import SamplingParams
    from ringtune.sample.sampler import generate

    model = load_hf(checkpoints["qwen3_5"][0], dtype=torch.float64).eval()
    sequences = vl_sequences(seed=8)[1:4]
    prompts = [ids.tolist() for ids, _ in sequences]
    images = [imgs for _, imgs in sequences]
    results = generate(model, prompts, SamplingParams(max_tokens=4, temperature=1.0, seed=3), images=images)
    full = [p + r.sequences[0].tokens for p, r in zip(prompts, results, strict=True)]
    shard = shard_of([len(s) for s in full], images=images, spatial_merge_size=2)
    ids = torch.cat([torch.tensor(s) for s in full])
    labels = next_token_labels(ids, tuple(len(s) for s in full))
    lp = model.label_logprobs(zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard)
    for s, p, r in zip(shard.plan.local_starts, prompts, results, strict=True):
        trainer = lp[s + len(p) - 1 : s + len(p) - 1 + len(r.sequences[0].tokens)]
        assert float((trainer - torch.tensor(r.sequences[0].logprobs, dtype=torch.float64)).abs().max()) < 1e-10
