"""The engine with images: packed rows of VL datums through the Trainer at DP×CP 4×1, 2×2, 1×4 (float64).

Outputs, losses, gradients (the global sum) and the weights after one AdamW step agree across layouts within
1e-10; the vision tower is trained (its weights move) unless ``freeze_vision``, which leaves it as loaded and
every language weight exactly as the unfrozen run moves it; bad images are refused before any compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.tiny_models import next_token_labels
from support.tiny_vl import SEQUENCES, hf_vl_model, vl_sequences

from ringtune.engine.batch import TrainDatum, build_batch
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.image_input import ImageInput

LAYOUTS = ((4, 1), (2, 2), (1, 4))
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0)


def vl_data(seed: int = 0) -> list[TrainDatum]:
    """One datum per :data:`SEQUENCES` entry (text only and 1-3 images), next-token targets, random weights."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for ids, images in vl_sequences(SEQUENCES, seed=seed):
        targets = next_token_labels(ids, (len(ids),)).clamp(min=0)
        inputs = {"target_tokens": targets, "weights": torch.randn(len(ids), generator=gen, dtype=torch.float64)}
        data.append(TrainDatum(tokens=ids, inputs=inputs, images=tuple(images)))
    return data


def layouts_case(ctx, *, root: str):
    results = {}
    for dp, cp in LAYOUTS:
        for freeze in (False, True) if (dp, cp) == (2, 2) else (False,):
            model = load_hf(root, dtype=torch.float64)
            trainer = Trainer(model, ctx.mesh(dp=dp, cp=cp), max_tokens_per_rank=64, freeze_vision=freeze)
            result = trainer.forward_backward(vl_data(), "cross_entropy")
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=trainer.dp_cp_group)  # the global gradient, as optim_step sees it
            trainer.optim_step(ADAM)
            if not trainer.is_result_rank:
                continue
            results[dp, cp, freeze] = {
                "loss": result.metrics["loss:sum"],
                "outputs": result.outputs,
                "grads": grads,
                "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
    return results


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_engine") / "qwen3_5"
    hf_vl_model("qwen3_5", seed=13).save_pretrained(root)
    return root


def test_layouts_agree_and_freeze_vision(pool4, checkpoint):
    loaded = load_hf(checkpoint, dtype=torch.float64).state_dict()
    per_rank = pool4.run(layouts_case, root=str(checkpoint))
    results = {key: value for rank in per_rank for key, value in rank.items()}  # each from its result rank
    assert len(results) == 4
    ref = results[4, 1, False]
    for key, got in results.items():
        assert abs(got["loss"] - ref["loss"]) < 1e-10, key
        for a, b in zip(got["outputs"], ref["outputs"], strict=True):
            assert _diff(a, b) < 1e-10, key
        if not key[2]:
            assert _diff(got["grads"], ref["grads"]) < 1e-10, key
            assert _diff(got["weights"], ref["weights"]) < 1e-10, key
    vision = [n for n in loaded if n.startswith("model.visual.")]
    assert all(float(ref["grads"][n].abs().max()) > 0 for n in vision)  # every tower tensor is trained
    frozen = results[2, 2, True]["weights"]
    for name, w in frozen.items():
        if name in vision:
            assert torch.equal(w, loaded[name]) and not torch.equal(ref["weights"][name], loaded[name]), name
        else:  # AdamW is per tensor and unclipped: the language weights move exactly as without the freeze
            assert float((w - ref["weights"][name]).abs().max()) < 1e-10, name


def test_bad_images_refused_before_compute(checkpoint):
    trainer = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=256)
    good = vl_data()
    image = good[1].images[0]
    cases = {
        "not the image token": ImageInput(
            pixel_values=image.pixel_values, grid_thw=image.grid_thw, token_start=0, num_tokens=image.num_tokens
        ),
        "makes": ImageInput(
            pixel_values=image.pixel_values, grid_thw=image.grid_thw, token_start=image.token_start, num_tokens=3
        ),
        "pixel_values must be": ImageInput(
            pixel_values=image.pixel_values[:-1],
            grid_thw=image.grid_thw,
            token_start=image.token_start,
            num_tokens=image.num_tokens,
        ),
    }
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for message, bad in cases.items():
        datum = TrainDatum(tokens=good[1].tokens, inputs=good[1].inputs, images=(bad,))
        with pytest.raises(UserInputError, match=message):
            trainer.forward_backward([good[0], datum], "cross_entropy")
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    with pytest.raises(UserInputError, match="no vision tower"):  # a text-only model refuses images
        build_batch(good, "cross_entropy", None, vocab_size=96, dp_size=1, cp_size=1, max_tokens_per_rank=256)


def moe_ep_case(ctx, *, root: str) -> dict[str, float]:
    """The MoE VL model through the Trainer at EP 2 (DP×CP 2×2 and 1×4) against the one-process Trainer:
    loss, log-probs, grad norm and post-step weights (experts gathered)."""
    from ringtune.models.layers.moe import gather_expert_state

    ref = Trainer(load_hf(root, dtype=torch.float64), None, max_tokens_per_rank=64)
    want = ref.forward_backward(vl_data(), "cross_entropy")
    want_norm = ref.optim_step(ADAM)["grad_norm:mean"]
    ref_weights = ref.model.state_dict()
    out = {}
    for dp, cp in ((2, 2), (1, 4)):
        model = load_hf(root, dtype=torch.float64)
        trainer = Trainer(model, ctx.mesh(dp=dp, cp=cp, ep=2), max_tokens_per_rank=64, gated_delta="chunkwise")
        got = trainer.forward_backward(vl_data(), "cross_entropy")
        norm = trainer.optim_step(ADAM)["grad_norm:mean"]
        weights = gather_expert_state(trainer.model)
        errors = [abs(norm - want_norm), _diff(ref_weights, weights)]
        if trainer.is_result_rank:
            errors.append(abs(got.metrics["loss:sum"] - want.metrics["loss:sum"]))
            errors += [_diff(a, b) for a, b in zip(got.outputs, want.outputs, strict=True)]
        out[f"DP{dp} CP{cp} EP2"] = max(errors)
    return out


def test_moe_vl_at_ep2_equals_one_process(pool4, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_moe") / "qwen3_5_moe"
    hf_vl_model("qwen3_5_moe", seed=17).save_pretrained(root)
    for rank, errors in enumerate(pool4.run(moe_ep_case, root=str(root))):
        for layout, error in errors.items():
            assert error < 1e-10, (rank, layout, error)
