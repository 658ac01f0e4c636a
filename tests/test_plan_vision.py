"""The vision tower in ``ringtune plan`` (:mod:`ringtune.plan.vision`): its parameter count equals transformers'
``Qwen3_5VisionModel`` for two shapes, and image tokens add the tower's patch activations to a step's peak
(about ``image_tokens / cp`` tokens' worth per rank); text configs refuse image tokens by name."""

from __future__ import annotations

import json

import pytest
from image_fixtures import tiny_vl_dir, vl_config

from ringtune.cli import main
from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.plan.estimate import Layout, estimate, snapshot_bytes
from ringtune.plan.models import KNOWN_MODELS
from ringtune.plan.search import plan_layouts
from ringtune.plan.vision import VisionShape, kept_per_patch, rank_patches, vision_parameters

WIDER = {
    "depth": 3,
    "hidden_size": 24,
    "intermediate_size": 40,
    "num_heads": 3,
    "spatial_merge_size": 3,
    "out_hidden_size": 48,
    "num_position_embeddings": 36,
    "patch_size": 8,
    "temporal_patch_size": 1,
}


@pytest.mark.parametrize("overrides", [{}, WIDER], ids=["tiny", "wider"])
def test_parameters_equal_transformers(overrides) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    config = vl_config().vision_config
    for key, value in overrides.items():
        setattr(config, key, value)
    model = Qwen3_5VisionModel(config)
    shape = VisionShape.from_hf(config.to_dict())
    assert vision_parameters(shape) == sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = tiny_vl_dir(tmp_path_factory.mktemp("plan-vl") / "ckpt", weights=False)
    return path, DecoderConfig.from_hf(json.loads((path / "config.json").read_text()))


def test_image_tokens_add_the_towers_patches(vl) -> None:
    _, cfg = vl
    shape = VisionShape.from_hf(cfg.hf_config["vision_config"])
    text_cfg = DecoderConfig.from_hf(cfg.hf_config["text_config"] | {"model_type": "qwen3_5_text"})
    layout = Layout(cp=2, dp=1, shard="none", recompute="full", precision="float32")
    text, zero, some = (estimate(c, layout, 512, image_tokens=n) for c, n in ((text_cfg, 0), (cfg, 0), (cfg, 400)))
    # float32: parameters, gradients and AdamW moments of the tower, 4 + 4 + 8 bytes each
    tower = vision_parameters(shape)
    assert zero.parameters - text.parameters == 4 * tower and zero.moments - text.moments == 8 * tower
    assert zero.detail["vision_parameters"] == tower and zero.detail["vision_patches_here"] == 0
    assert some.detail["vision_patches_here"] == rank_patches(shape, 400, 2) == 200 * 4
    kept = kept_per_patch(shape, 4, 4) * 800
    assert some.activations - zero.activations == pytest.approx(kept) and some.phase == zero.phase
    assert snapshot_bytes(cfg, layout) - snapshot_bytes(text_cfg, layout) == 4 * tower
    at_cp4 = estimate(
        cfg, Layout(cp=4, dp=1, shard="none", recompute="full", precision="float32"), 256, image_tokens=400
    )
    assert at_cp4.detail["vision_patches_here"] == 100 * 4


def test_refusals_and_the_cli(vl, capsys) -> None:
    path, cfg = vl
    text_cfg = DecoderConfig.from_hf(KNOWN_MODELS["Qwen3.5-4B"])
    layout = Layout(cp=1, dp=1, shard="none", recompute="full", precision="float32")
    with pytest.raises(UserInputError, match=r"--image-tokens=8: the model has no vision tower"):
        estimate(text_cfg, layout, 1024, image_tokens=8)
    with pytest.raises(UserInputError, match=r"--image-tokens=-1: must be an integer >= 0"):
        estimate(cfg, layout, 1024, image_tokens=-1)
    with pytest.raises(UserInputError, match=r"--image-tokens=2048: more than the row's 1024 tokens"):
        plan_layouts(cfg, context=1024, gpus=2, memory=1 << 30, image_tokens=2048)
    argv = ["plan", "--model", str(path), "--context-length", "1024", "--gpus", "2", "--gpu-memory", "1GiB"]
    assert main([*argv, "--image-tokens", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["image_tokens"] == 512 and all(r["detail"]["vision_parameters"] > 0 for r in out["layouts"])
    assert main([*argv, "--image-tokens", "4096"]) == 2
    assert "--image-tokens=4096" in capsys.readouterr().err
