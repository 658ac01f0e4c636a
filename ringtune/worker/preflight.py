"""Start-up checks of ``ringtune serve``: every setting against the model, before any rank is spawned.

A configuration that cannot serve is refused here, at start-up, with the flag, its value and the limit
(:class:`~ringtune.errors.UserInputError`: ``ringtune serve`` prints ``error: ...`` and exits 2), never at
the first ``create_model`` or long-prompt sample, where a client would be told it was its own fault.

Checked, from the model's config alone (``config.json`` or the GGUF metadata; no weights are read):

- the precision (``--dtype``), the recompute mode, the FSDP sharding (which needs more than one rank) and the
  hidden debug fault are names of their registries;
- the CP modes fit the model's heads at this CP size (:meth:`DecoderConfig.check_parallel`). A mode given
  on the command line is kept or refused; a mode left at its default is the first of its registry
  (:mod:`ringtune.ops.cp_modes`) that fits, and :attr:`Preflight.notes` says which and why, for the banner
  (``ringtune serve --cp 4`` on a model with 2 GatedDeltaNet key heads serves with ``chunkwise``);
- the per-rank token budget holds at least one datum at this CP size;
- ``--mesh-prompt-tokens`` is >= 0; an explicit ``--tokenizer`` directory holds a tokenizer.

A context longer than the model's ``max_position_embeddings`` is served (rotary positions extend) and noted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from ringtune.debug_faults import check_fault
from ringtune.engine.packing import MIN_LOCAL_LEN, max_datum_len
from ringtune.engine.sharding import check_sharding
from ringtune.errors import ParallelConfigError, UserInputError
from ringtune.layout.zigzag import stream_pad_multiple
from ringtune.models.checkpoints.gguf import _llama_config, smollm2_gguf_path
from ringtune.models.checkpoints.gguf_file import GGUFFile
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT
from ringtune.models.config import DecoderConfig
from ringtune.models.precision import check_precision
from ringtune.models.recompute import check_recompute_mode
from ringtune.ops.cp_modes import ATTENTION_MODES, GATED_DELTA_MODES
from ringtune.worker.describe import find_tokenizer_dir
from ringtune.worker.executor import PAD_MULTIPLIER


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """What ``ringtune serve`` was asked for; ``attention`` / ``gated_delta`` None: not given (choose one)."""

    source: str
    dp: int = 1
    cp: int = 1
    ep: int = 1
    attention: str | None = None
    gated_delta: str | None = None
    dtype: str = "float32"
    max_tokens_per_rank: int = 8192
    shard_params: str = "none"
    recompute: str = "none"
    mesh_prompt_tokens: int | None = None
    tokenizer_dir: str | None = None
    debug_fault: str | None = None
    routing_replay: bool = False


@dataclass(frozen=True, kw_only=True)
class Preflight:
    """The modes to serve with (every one fits the model) and the notes for the banner."""

    config: DecoderConfig
    attention: str
    gated_delta: str
    context_length: int
    notes: tuple[str, ...] = ()


def read_config(source: str) -> DecoderConfig:
    """The model's :class:`DecoderConfig` from ``config.json`` or the GGUF metadata (no weights read)."""
    path = smollm2_gguf_path() if source == EMBEDDED_DEFAULT else Path(source)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise UserInputError(f"--model {source!r}: config.json not found in the directory")
        return DecoderConfig.from_hf(json.loads(config_file.read_text()))
    if path.is_file() and path.suffix == ".gguf":
        with GGUFFile(path) as f:
            arch = f.metadata.get("general.architecture")
            if arch != "llama":
                raise UserInputError(f"--model {source!r}: GGUF general.architecture={arch!r}; only 'llama' is read")
            if "token_embd.weight" not in f.tensors:
                raise UserInputError(f"--model {source!r}: no token_embd.weight tensor")
            vocab = f.tensors["token_embd.weight"].shape[0]
            hf = _llama_config(f.metadata, vocab, tied="output.weight" not in f.tensors, path=path)
        return DecoderConfig.from_hf(hf)
    raise UserInputError(f"--model {source!r}: not an HF checkpoint directory, a .gguf file or {EMBEDDED_DEFAULT!r}")


def _choose_modes(config: DecoderConfig, s: ServeSettings) -> tuple[str, str, list[str]]:
    """The first (attention, gated_delta) pair in registry order that fits, explicit modes fixed; notes."""
    attentions = (s.attention,) if s.attention is not None else ATTENTION_MODES
    deltas = (s.gated_delta,) if s.gated_delta is not None else GATED_DELTA_MODES
    refusals: list[str] = []
    for attention, gated_delta in product(attentions, deltas):
        try:
            config.check_parallel(cp_size=s.cp, attention=attention, gated_delta=gated_delta)
        except ParallelConfigError as exc:
            refusals.append(str(exc))
            continue
        notes = []
        if attention != attentions[0] or gated_delta != deltas[0]:
            notes.append(
                f"modes chosen for CP={s.cp}: {attention} attention, {gated_delta} GDN (the defaults do not fit: "
                f"{refusals[0]})"
            )
        return attention, gated_delta, notes
    flags = f"--cp {s.cp}" + (f" --attention {s.attention}" if s.attention else "")
    flags += f" --linear-cp-mode {s.gated_delta}" if s.gated_delta else ""
    raise UserInputError(f"{flags} cannot serve {config.model_type}: {refusals[0]}")


def preflight(s: ServeSettings) -> Preflight:
    """Check ``s`` against the model; raises UserInputError naming the flag, value and limit (see module doc)."""
    for name in ("dp", "cp", "ep"):
        if getattr(s, name) < 1:
            raise UserInputError(f"--{name}={getattr(s, name)} must be >= 1")
    if (s.dp * s.cp) % s.ep:
        raise UserInputError(f"--ep={s.ep} must divide --dp x --cp = {s.dp * s.cp} (EP is carved out of those ranks)")
    if s.ep > 1 and s.shard_params not in ("none", "dp_cp"):
        raise UserInputError(
            f"--shard-params={s.shard_params} with --ep={s.ep}: under expert parallelism use --shard-params dp_cp "
            "(experts sharded over their expert replica group, docs/moe.md) or none"
        )
    check_precision(s.dtype, field="--dtype")
    check_recompute_mode(s.recompute, field="--recompute")
    check_sharding(s.shard_params, field="--shard-params")
    if s.shard_params != "none" and s.dp * s.cp == 1:
        raise UserInputError(f"--shard-params={s.shard_params} needs more than one rank (--dp x --cp > 1)")
    try:
        check_fault(s.debug_fault)
    except ValueError as exc:
        raise UserInputError(f"--debug-fault: {exc}") from exc
    if s.mesh_prompt_tokens is not None and s.mesh_prompt_tokens < 0:
        raise UserInputError(f"--mesh-prompt-tokens={s.mesh_prompt_tokens} must be >= 0")
    if s.tokenizer_dir is not None:
        find_tokenizer_dir(s.source, s.tokenizer_dir, None)
    config = read_config(s.source)
    if s.ep > 1 and (not config.has_moe or config.num_experts % s.ep):
        raise UserInputError(f"--ep={s.ep} must divide the model's num_experts={config.num_experts} (0: not MoE)")
    attention, gated_delta, notes = _choose_modes(config, s)
    context = max_datum_len(s.max_tokens_per_rank, cp_size=s.cp, multiple=stream_pad_multiple(1, PAD_MULTIPLIER))
    if context < 1:
        raise UserInputError(
            f"--max-tokens-per-rank={s.max_tokens_per_rank} holds no datum at CP={s.cp}; use >= {MIN_LOCAL_LEN}"
        )
    limit = config.hf_config.get("max_position_embeddings")
    if isinstance(limit, int) and context > limit:
        notes.append(f"context {context} tokens exceeds the model's max_position_embeddings={limit} (served anyway)")
    if s.routing_replay and not config.has_moe:
        notes.append("--routing-replay has nothing to record: the model has no MoE layer")
    return Preflight(
        config=config, attention=attention, gated_delta=gated_delta, context_length=context, notes=tuple(notes)
    )
