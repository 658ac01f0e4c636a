"""The parity matrix's tiny checkpoints (:mod:`ringtune.parity.tiny_checkpoint`): built without transformers,
reproducible from their seed, bfloat16-exact, no identity norm, routers that route, and loaded alike by ringtune
and by transformers."""

from __future__ import annotations

import pytest
import torch

from ringtune.layout.zigzag import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf, read_state_dict
from ringtune.models.shard import shard_of
from ringtune.parity.tiny_checkpoint import TINY_CONFIGS, TINY_MARK, tiny_qwen35_dir


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_tiny_checkpoint_is_seeded_and_bf16_exact(tmp_path, family):
    one = read_state_dict(tiny_qwen35_dir(tmp_path / "a", family=family, seed=3))
    again = read_state_dict(tiny_qwen35_dir(tmp_path / "b", family=family, seed=3))
    other = read_state_dict(tiny_qwen35_dir(tmp_path / "c", family=family, seed=4))
    assert one.keys() == again.keys() == other.keys()
    for name, tensor in one.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, again[name]), name
        assert torch.equal(tensor, tensor.to(torch.bfloat16).float()), name  # bf16 values stored as float32
        if not name.endswith(("A_log", "dt_bias")):
            assert not torch.equal(tensor, other[name]), name
        if "norm" in name:  # identity + noise: 0 for the zero-centred norms, 1 for the GDN output norm
            centre = 1.0 if "linear_attn.norm" in name else 0.0
            assert 0.03 < (tensor - centre).std() < 0.3, name
    routers = [t for n, t in one.items() if n.endswith("mlp.gate.weight")]
    assert bool(routers) == (family == "qwen3_5_moe")
    for router in routers:
        assert 0.3 < router.std() < 0.7  # logits of std ~3: neighbouring tokens pick different experts


def test_tiny_checkpoint_is_reused_only_for_its_family_and_seed(tmp_path):
    dest = tiny_qwen35_dir(tmp_path / "tiny", seed=0)
    weights = (dest / "model.safetensors").stat().st_mtime_ns
    assert tiny_qwen35_dir(dest, seed=0) == dest
    assert (dest / "model.safetensors").stat().st_mtime_ns == weights
    tiny_qwen35_dir(dest, seed=1)
    assert "seed=1" in (dest / TINY_MARK).read_text()
    with pytest.raises(ValueError, match="family must be one of"):
        tiny_qwen35_dir(tmp_path / "x", family="llama")


def test_transformers_reads_the_tiny_checkpoint_as_ringtune_does(tmp_path):
    """The checkpoint is a real HF directory: transformers' Qwen3.5 computes ringtune's log-probs from it."""
    transformers = pytest.importorskip("transformers")
    dest = tiny_qwen35_dir(tmp_path / "tiny", seed=0)
    ours = load_hf(dest, dtype=torch.float64)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float64)
    ids = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1)
    with torch.no_grad():
        logits = theirs(input_ids=ids[None]).logits[0].log_softmax(-1)
        want = logits.gather(-1, labels[:, None])[:, 0]
        shard = shard_of((23,))  # CP=1: the row padded to the layout's multiple
        got = ours(zigzag_slice(ids, shard.plan), shard, zigzag_slice(labels, shard.plan, pad_value=-100))
    # Both float64, yet transformers rounds a few steps of its Qwen3.5 through float32: 3.4e-8 measured.
    torch.testing.assert_close(got[:23], want, rtol=0, atol=1e-6)
