"""What the gateway reports about the served model (:class:`~ringtune.gateway.backend.BackendInfo`), for any layout.

Built on rank 0 from the loaded model and the serve settings: names, architecture, the tokenizer directory
clients load offline, the longest datum one request may hold at this per-rank budget and CP size, the layout
and the engine options that shape the numbers.
"""

from __future__ import annotations

from pathlib import Path

from ringtune.engine.packing import max_datum_len
from ringtune.errors import UserInputError
from ringtune.gateway.backend import BackendInfo
from ringtune.gateway.images import vl_config
from ringtune.layout.zigzag import stream_pad_multiple
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT
from ringtune.models.decoder import CausalLM
from ringtune.models.lora import lora_params_per_rank
from ringtune.worker.executor import ModelSpec


def find_tokenizer_dir(source: str, explicit: str | None, cache_dir: str | Path | None) -> str | None:
    """The tokenizer directory to report: ``explicit``; else the source HF dir if it has ``tokenizer.json``;
    else, for the embedded default, SmolLM2's tokenizer built once under ``cache_dir``; else None."""
    if explicit is not None:
        path = Path(explicit).resolve()
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise UserInputError(f"tokenizer dir {explicit!r} has neither tokenizer.json nor tokenizer_config.json")
        return str(path)
    src = Path(source)
    if src.is_dir() and (src / "tokenizer.json").is_file():
        return str(src.resolve())
    if source == EMBEDDED_DEFAULT and cache_dir is not None:
        from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir

        dest = Path(cache_dir).resolve() / "smollm2-135m"
        if not (dest / "tokenizer.json").is_file():
            smollm2_tokenizer_dir(dest)
        return str(dest)
    return None


def image_dir(source: str, model: CausalLM) -> str | None:
    """The directory image chunks are decoded with (:attr:`BackendInfo.image_dir`): ``source`` when it is a
    vision-language checkpoint (:func:`ringtune.gateway.images.vl_config`) and the loaded model has its vision
    tower (``model.model.visual``); else None (image chunks refused by name)."""
    if getattr(model.model, "visual", None) is None or not Path(source).is_dir() or vl_config(source) is None:
        return None
    return str(Path(source).resolve())


def describe(
    spec: ModelSpec,
    model: CausalLM,
    *,
    dp: int = 1,
    cp: int = 1,
    model_name: str | None = None,
    tokenizer_dir: str | None = None,
    tokenizer_cache: str | Path | None = None,
) -> BackendInfo:
    """The served model as the gateway reports it (context length = the longest datum one rank row holds).

    Raises UserInputError when ``spec.max_tokens_per_rank`` holds no datum at all.
    """
    modes = spec.modes
    context = max_datum_len(
        spec.max_tokens_per_rank, cp_size=cp, multiple=stream_pad_multiple(1, modes["pad_multiplier"])
    )
    if context < 1:
        raise UserInputError(f"max_tokens_per_rank={spec.max_tokens_per_rank} holds no datum; use >= 16")
    name = model_name or spec.source
    return BackendInfo(
        image_dir=image_dir(spec.source, model),
        model_name=name,
        aliases=tuple(a for a in (spec.source,) if a != name),
        arch=model.config.model_type,
        tokenizer_dir=find_tokenizer_dir(spec.source, tokenizer_dir, tokenizer_cache),
        context_length=context,
        max_tokens_per_rank=spec.max_tokens_per_rank,
        dp_size=dp,
        cp_size=cp,
        dtype=spec.dtype,
        vocab_size=model.config.vocab_size,
        modes=modes,
        param_count=sum(p.numel() for p in model.parameters()),
        lora_params_per_rank=lora_params_per_rank(model),
    )
