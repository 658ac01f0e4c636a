"""The planner's MoE terms: parameter counts against the real MoE models, experts ÷ EP, EP layouts offered."""

from __future__ import annotations

import pytest
from support.tiny_models import hf_model

from ringtune.errors import UserInputError
from ringtune.models.decoder import CausalLM
from ringtune.plan.estimate import Layout, estimate
from ringtune.plan.search import plan_layouts

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_moe_parameters_and_expert_sharding(family: str) -> None:
    from ringtune.models.config import DecoderConfig

    cfg = DecoderConfig.from_hf(hf_model(family, seed=1).config.to_dict())
    model = CausalLM(cfg)
    want = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    one = estimate(cfg, Layout(cp=2, dp=1, shard="none", recompute="none", precision="float32"), 256)
    two = estimate(cfg, Layout(cp=2, dp=1, shard="none", recompute="none", precision="float32", ep=2), 256)
    assert one.detail["parameter_count"] == want
    assert one.detail["expert_parameters_here"] == experts
    assert two.detail["expert_parameters_here"] == experts / 2
    assert one.parameters - two.parameters == 4 * experts / 2  # float32: the other half of the experts
    assert one.moments - two.moments == 8 * experts / 2
    assert two.communication > one.communication or two.phase == "optimizer"  # dispatch buffers at EP > 1
    del model
    with pytest.raises(UserInputError, match="ep=3 must divide the model's num_experts=8"):
        estimate(cfg, Layout(cp=1, dp=3, shard="none", recompute="none", precision="float32", ep=3), 64)
    planned = plan_layouts(cfg, context=512, gpus=4, memory=2**30, precisions=("float32",))
    assert {p.estimate.layout.ep for p in planned} == {1, 2, 4}
    # FSDP under EP (dp_cp): each rank 1/(DP·CP) of the experts, as without EP; HSDP (dp) refused under EP
    assert {(p.estimate.layout.shard, p.estimate.layout.ep) for p in planned} >= {("dp_cp", 2), ("dp_cp", 4)}
    for ep in (1, 2, 4):
        fsdp = estimate(cfg, Layout(cp=2, dp=2, shard="dp_cp", recompute="none", precision="float32", ep=ep), 256)
        assert fsdp.detail["expert_parameters_here"] == experts / 4
    with pytest.raises(UserInputError, match="only shard='dp_cp'"):
        estimate(cfg, Layout(cp=2, dp=2, shard="dp", recompute="none", precision="float32", ep=2), 64)
