"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (one file, or sharded with an index).

Loading maps the few prefixes real Qwen3.5 checkpoints use (``model.language_model.*`` of the VL layout)
onto the text decoder, loads a VL checkpoint's vision tower (``model.visual.*``, names unchanged) whole, skips
the MTP head, and refuses missing or unknown tensors by name; a VL config whose checkpoint holds no
``model.visual.*`` tensor loads as text only. Saving a model with a vision tower writes transformers' VL names
(``model.language_model.*``, ``model.visual.*``, ``lm_head``). MoE experts: transformers 5 saves each expert apart
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, the original Qwen layout) and holds them fused in memory
(``mlp.experts.gate_up_proj`` [E, 2·I, hidden] = gate rows then up rows, ``mlp.experts.down_proj``
[E, hidden, I]); loading accepts either, saving writes the per-expert layout transformers writes. An
expert-parallel rank loads its own experts only (``load_hf(..., ep=(rank, size))``): other experts' tensors are
never read (fused ones are read as a slice), so a rank's peak is its share, not the whole model.
Saving writes into a temporary directory beside the target and renames it into place, so a crash
mid-save never leaves a half-written checkpoint at ``path``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.moe import moe_blocks

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PREFIX_MAP = (("model.language_model.", "model."), ("visual.", "model.visual."))
SKIPPED_PREFIXES = ("mtp.",)
VISUAL_PREFIX = "model.visual."


def _hf_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor name, or None for tensors the decoder skips (MTP head)."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for old, new in PREFIX_MAP:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(
    state: dict[str, torch.Tensor], num_experts: int, where: str, experts: range | None = None
) -> dict[str, torch.Tensor]:
    """Per-expert tensors (``….mlp.experts.{e}.gate_proj.weight`` …) -> the fused ``gate_up_proj`` / ``down_proj``
    of ``experts`` (default all ``num_experts``).

    Other tensors pass through. Raises UserInputError naming the first missing or out-of-range expert tensor.
    """
    wanted = range(num_experts) if experts is None else experts
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _EXPERT_KEY.match(name)
        if match is None:
            out[name] = tensor
            continue
        e = int(match["e"])
        if e >= num_experts:
            raise UserInputError(f"checkpoint {where}: {name}: expert {e} >= num_experts={num_experts}")
        parts.setdefault(match["prefix"], {})[(match["proj"], e)] = tensor
    for prefix, got in parts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for e in wanted:
                if (proj, e) not in got:
                    raise UserInputError(f"checkpoint {where}: missing tensors ['{prefix}.{e}.{proj}.weight']")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([got["gate_proj", e], got["up_proj", e]]) for e in wanted]
        )
        out[f"{prefix}.down_proj"] = torch.stack([got["down_proj", e] for e in wanted])
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_experts`: fused expert tensors -> transformers' saved per-expert layout."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e, down in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = tensor
    return out


def read_state_dict(
    path: str | Path, *, experts: range | None = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in directory ``path`` (single file or sharded index), read
    straight onto ``device``; ``experts``: of the routed experts only these (other experts' per-expert tensors are
    not read, fused expert tensors are read as that slice)."""
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
        with safe_open(path / name, framework="pt", device=str(device)) as f:
            for key in f.keys():
                ours = _hf_name(key) if experts is not None else None
                if ours is not None and (match := _EXPERT_KEY.match(ours)) is not None:
                    if int(match["e"]) in experts:  # type: ignore[operator]
                        tensors[key] = f.get_tensor(key)
                elif ours is not None and ours.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                    tensors[key] = f.get_slice(key)[experts.start : experts.stop]  # type: ignore[union-attr]
                else:
                    tensors[key] = f.get_tensor(key)
    return tensors


def _tensor_names(path: Path) -> list[str]:
    """Our names of every tensor in the checkpoint directory (read from the index or the file headers)."""
    index = path / INDEX_NAME
    if index.exists():
        names = list(json.loads(index.read_text())["weight_map"])
    elif (path / SINGLE_NAME).exists():
        with safe_open(path / SINGLE_NAME, framework="pt") as f:
            names = list(f.keys())
    else:
        raise UserInputError(f"checkpoint {path}: neither {SINGLE_NAME} nor {INDEX_NAME} exists")
    return [ours for n in names if (ours := _hf_name(n)) is not None]


def hf_saved_name(name: str, *, vision_language: bool) -> str:
    """The name transformers saves our parameter ``name`` under: a VL model's text decoder lives under
    ``model.language_model.`` (its tower keeps ``model.visual.``); a text model's names are ours."""
    if vision_language and name.startswith("model.") and not name.startswith(VISUAL_PREFIX):
        return "model.language_model." + name[len("model.") :]
    return name


def load_hf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    ep: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Build a :class:`CausalLM` from an HF directory (``config.json`` + safetensors).

    Args:
        path: the checkpoint directory.
        dtype: parameter dtype; default the checkpoint's own (float32 if it mixes dtypes).
        ep: ``(rank, size)`` of an expert-parallel group: a MoE model keeps experts ``[rank·E/size,
            (rank+1)·E/size)`` of every MoE layer, and only those are read (the model is then ready for
            :func:`~ringtune.models.layers.moe.set_expert_parallel` on that group); ignored without MoE.
        device: where the parameters live; the safetensors are read straight onto it (no host copy of a GPU
            rank's weights).
    Raises:
        UserInputError: unsupported config, or tensors missing / unknown / of the wrong shape (named);
            ParallelConfigError when ``size`` does not divide the number of experts.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise UserInputError(f"checkpoint {path}: config.json not found")
    config = DecoderConfig.from_hf(json.loads(config_file.read_text()))
    if config.vision is not None and not any(n.startswith(VISUAL_PREFIX) for n in _tensor_names(path)):
        config = replace(config, vision=None)  # a VL config over text weights only: the text decoder
    experts = None
    if ep is not None and ep[1] > 1 and config.has_moe:
        rank, size = ep
        config.check_expert_parallel(size)
        local = config.num_experts // size
        experts = range(rank * local, (rank + 1) * local)
    raw = read_state_dict(path, experts=experts, device=device)
    state = {ours: t for name, t in raw.items() if (ours := _hf_name(name)) is not None}
    if config.has_moe:
        state = fuse_experts(state, config.num_experts, str(path), experts)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dtypes = {t.dtype for t in state.values()}
    dtype = dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
    with torch.device("meta"):
        model = CausalLM(config)
        if experts is not None:
            for block in moe_blocks(model):
                block.experts.keep(experts.start, len(experts))
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
    :func:`ringtune.engine.sharding.full_state_dict`); None: ``model.state_dict()``. MoE experts are written
    per expert, as transformers saves them; an expert-parallel model needs ``state`` with every expert
    (:func:`ringtune.models.layers.moe.gather_expert_state`). A model with a vision tower is written under
    transformers' VL names (:func:`hf_saved_name`: ``model.language_model.*``, ``model.visual.*``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = model.state_dict() if state is None else state
    state = {n: t.detach().contiguous().cpu() for n, t in source.items()}
    num_experts = model.config.num_experts
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.down_proj") and tensor.shape[0] != num_experts:
            raise ValueError(
                f"save_hf: {name} holds {tensor.shape[0]} of num_experts={num_experts} experts (expert-parallel "
                "shard); pass state=gather_expert_state(model)"
            )
    state = split_experts(state)
    vision_language = model.config.vision is not None
    state = {hf_saved_name(n, vision_language=vision_language): t for n, t in state.items()}
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
