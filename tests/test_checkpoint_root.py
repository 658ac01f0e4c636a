"""Tests of ringtune.engine.checkpoint_root: tinker paths, listing with sizes and publish times, deletion.

Name rules, traversal and symlinks out of the root are in tests/test_checkpoint_corruption.py (with save and load).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from ringtune.engine.checkpoint import export_hf_weights, load_checkpoint, save_checkpoint
from ringtune.engine.checkpoint_root import CheckpointNotFoundError, CheckpointRef, CheckpointRoot
from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM

RUN = "sess-1:train:0"


def tiny_model(seed: int) -> CausalLM:
    """A float64 2-layer Qwen3-style CausalLM with random weights (no transformers needed)."""
    config = DecoderConfig.from_hf(
        {
            "model_type": "qwen3",
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 24,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "tie_word_embeddings": True,
        }
    )
    torch.manual_seed(seed)
    return CausalLM(config).double()


def files_size(path: Path) -> int:
    real = path.resolve()
    return sum(f.stat().st_size for f in real.rglob("*") if f.is_file())


def test_tinker_paths():
    ref = CheckpointRoot.parse("tinker://sess-1:train:0/weights/step_0004")
    assert ref == CheckpointRef(run_id=RUN, kind="weights", name="step_0004")
    assert (ref.tinker_path, ref.checkpoint_id, ref.checkpoint_type) == (
        "tinker://sess-1:train:0/weights/step_0004",
        "weights/step_0004",
        "training",
    )
    assert CheckpointRoot.parse("tinker://r/sampler_weights/s").checkpoint_type == "sampler"
    for bad, match in (
        ("file:///etc/passwd", r"path='file:///etc/passwd' is not a tinker path"),
        ("tinker://r/weights", r"has 2 '/'-separated parts after tinker://; must be exactly 3"),
        ("tinker://r/weights/a/b", r"has 4 '/'-separated parts"),
        (
            "tinker://r/lora_weights/a",
            r"path kind='lora_weights' is not one of \['weights', 'sampler_weights', 'external_weights'\]",
        ),
        ("tinker://../weights/a", r"path run_id='\.\.' starts with '\.'"),
        (None, "is not a tinker path"),
    ):
        with pytest.raises(UserInputError, match=match):
            CheckpointRoot.parse(bad)


def test_list_info_and_delete(tmp_path):
    root = CheckpointRoot(tmp_path / "ckpts")
    assert root.directory == (tmp_path / "ckpts").resolve() and root.directory.is_dir()
    assert root.checkpoints(RUN) == []
    model = tiny_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()

    started = time.time()
    save_checkpoint(root.path(RUN, "weights", "a"), model=model, optimizer=optimizer, step=1)
    save_checkpoint(root.path(RUN, "weights", "b"), model=model, optimizer=None, step=1)
    save_checkpoint(root.path(RUN, "weights", "b"), model=model, optimizer=None, step=2)  # replaced in place
    export_hf_weights(model, root.path(RUN, "sampler_weights", "s"))
    finished = time.time()
    weights = root.run_dir(RUN) / "weights"
    (weights / ".c.ckpt-0123456789abcdef0123456789abcdef.partial").mkdir()  # an interrupted save: not listed
    (weights / "notes.txt").write_text("not a checkpoint")
    (weights / "bad name").mkdir()
    root.run_dir("other").mkdir()

    assert len(root.checkpoints(RUN)) == 3
    assert all(started - 1 <= i.mtime <= finished + 1 for i in root.checkpoints(RUN))  # the publish time
    # Publish times decide the order: make them distinct.
    for offset, (kind, name) in enumerate((("sampler_weights", "s"), ("weights", "b"), ("weights", "a"))):
        stamp = int(started) + offset  # whole seconds: exact on every filesystem
        os.utime(root.path(RUN, kind, name), (stamp, stamp), follow_symlinks=False)
    listed = root.checkpoints(RUN)
    assert [(i.ref.kind, i.ref.name) for i in listed] == [("sampler_weights", "s"), ("weights", "b"), ("weights", "a")]
    assert [i.mtime for i in listed] == [int(started), int(started) + 1, int(started) + 2]
    for info in listed:
        assert info.path == root.path(RUN, info.ref.kind, info.ref.name)
        assert info.size_bytes == files_size(info.path) > 0
        assert info.ref.tinker_path == f"tinker://{RUN}/{info.ref.kind}/{info.ref.name}"
    assert listed[2].size_bytes > listed[1].size_bytes  # AdamW moments make "a" bigger than weights-only "b"
    assert [i.ref.name for i in root.checkpoints(RUN, "weights")] == ["b", "a"]
    assert root.info(RUN, "weights", "a") == listed[2]
    assert root.checkpoints("other") == []
    with pytest.raises(UserInputError, match=r"checkpoint kind='ephemeral' is not one of"):
        root.checkpoints(RUN, "ephemeral")

    # Delete a training checkpoint: the name and every hidden version of it go; the others stay loadable.
    gone = root.delete(RUN, "weights", "a")
    assert gone == listed[2]
    assert not os.path.lexists(gone.path)
    assert not [p for p in weights.iterdir() if p.name.startswith(".a.")]
    assert [(i.ref.kind, i.ref.name) for i in root.checkpoints(RUN)] == [("sampler_weights", "s"), ("weights", "b")]
    assert load_checkpoint(root.path(RUN, "weights", "b"), model=tiny_model(1), optimizer=None) == (2, {})
    root.delete(RUN, "sampler_weights", "s")
    assert not os.path.lexists(root.path(RUN, "sampler_weights", "s"))
    assert not list((root.run_dir(RUN) / "sampler_weights").iterdir())
    assert [i.ref.name for i in root.checkpoints(RUN)] == ["b"]

    with pytest.raises(CheckpointNotFoundError, match=rf"checkpoint tinker://{RUN}/weights/a does not exist"):
        root.delete(RUN, "weights", "a")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        root.info(RUN, "sampler_weights", "b")  # a name of the other kind
    with pytest.raises(UserInputError, match=r"checkpoint name='\.\./b' starts with '\.'"):
        root.delete(RUN, "weights", "../b")
    assert (weights / "notes.txt").read_text() == "not a checkpoint"
