"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (one file, or sharded with an index).

Loading maps the few prefixes real Qwen3.5 checkpoints use (``model.language_model.*`` of the VL layout)
onto the text decoder, skips the parts a text decoder has no use for (vision tower, MTP head), and
refuses missing or unknown tensors by name. Saving writes into a temporary directory beside the target
and renames it into place, so a crash mid-save never leaves a half-written checkpoint at ``path``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PREFIX_MAP = (("model.language_model.", "model."),)
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")


def _hf_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor name, or None for tensors a text decoder skips."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for old, new in PREFIX_MAP:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in directory ``path`` (single file or sharded index)."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        raise UserInputError(f"checkpoint {path}: neither {SINGLE_NAME} nor {INDEX_NAME} exists")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def load_hf(path: str | Path, *, dtype: torch.dtype | None = None) -> CausalLM:
    """Build a :class:`CausalLM` from an HF directory (``config.json`` + safetensors).

    Args:
        path: the checkpoint directory.
        dtype: parameter dtype; default the checkpoint's own (float32 if it mixes dtypes).
    Raises:
        UserInputError: unsupported config, or tensors missing / unknown / of the wrong shape (named).
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise UserInputError(f"checkpoint {path}: config.json not found")
    config = DecoderConfig.from_hf(json.loads(config_file.read_text()))
    raw = read_state_dict(path)
    state = {ours: t for name, t in raw.items() if (ours := _hf_name(name)) is not None}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dtypes = {t.dtype for t in state.values()}
    dtype = dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise UserInputError(f"checkpoint {path}: missing tensors {missing[:8]}, unknown tensors {unknown[:8]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UserInputError(
                f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, config needs {tuple(expected[name].shape)}"
            )
    model.load_state_dict({n: t.to(dtype) for n, t in state.items()}, assign=True)
    return model


def save_hf(
    model: CausalLM,
    path: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``model`` as an HF checkpoint directory that ``transformers`` loads; atomic (rename into place).

    Tensors go to ``model.safetensors``, or to numbered shards with ``model.safetensors.index.json`` when
    larger than ``max_shard_bytes``. Tied embeddings are saved once (no ``lm_head.weight``). ``dtype``: the
    floating tensors are written in it (rounded to nearest), and ``config.json`` says so; None keeps the model's.
    ``state``: the tensors to write (whole, keyed like ``model.state_dict()``, e.g. an FSDP model's gathered by
    :func:`ringtune.engine.sharding.full_state_dict`); None: ``model.state_dict()``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = model.state_dict() if state is None else state
    state = {n: t.detach().contiguous().cpu() for n, t in source.items()}
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        config = dict(model.config.hf_config)
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(next(iter(state.values())).dtype)[6:]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_NAME, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / name, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
