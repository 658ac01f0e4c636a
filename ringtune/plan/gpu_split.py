"""Splitting GPUs between training ranks and vLLM sampling engines (``ringtune plan --vllm-engines``, for
``ringtune serve --sampler vllm --vllm-engines N --vllm-devices ...``).

An engine of tensor x pipeline parallelism k (``--vllm-tp``; vLLM's ``--tensor-parallel-size`` x
``--pipeline-parallel-size``) runs on k GPUs of one node and holds, per GPU (:func:`engine_needs`):

- its weights, P·b / k (P the model's parameters, b the bytes of the engine's dtype);
- vLLM's runtime, :data:`ENGINE_RUNTIME_BYTES` (CUDA context, the profiled forward's activations, CUDA graphs);
- the KV cache: what is left of ``utilization`` (vLLM's ``--gpu-memory-utilization``, default 0.9) of the
  GPU. A sequence of L tokens takes L x (KV bytes per token) of it: 2 (K and V) x ceil(kv heads / k) x head dim
  x b per full-attention layer (vLLM replicates a KV head over the GPUs when k exceeds the heads), plus per
  sequence the GatedDeltaNet state of each linear-attention layer (v heads x dk x dv, and the convolution's
  (kernel - 1) x (2 k-heads x dk + v heads x dv)), split over the k GPUs. vLLM refuses to start when one
  sequence of ``--max-model-len`` does not fit.

The training ranks take the other GPUs: the best layout of :func:`~ringtune.plan.search.plan_layouts` on them
(sampler snapshots as asked: with ``--sampler vllm`` a rank holds none, unless prompt log-probs of a LoRA engine
are answered by ringtune's forward). ``torchrun`` starts the same number of ranks on every node, so engines
come in multiples of the node count, the same number on every node, and every node keeps at least one rank.

The recommended split (:func:`recommended`): the fewest engines whose KV caches hold ``sequences`` concurrent
sequences of ``sample_context`` tokens in all, with a training layout that fits; the rest train.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.plan import moe
from ringtune.plan.estimate import layer_parameters, root_parameters
from ringtune.plan.search import Planned, plan_layouts

GIB = 2**30

ENGINE_RUNTIME_BYTES = 3 * GIB
"""Per engine GPU besides weights and KV cache (an estimate, not measured here): the CUDA context (~0.5 GiB),
vLLM's profiling forward at its default 8192 batched tokens, sampler buffers and CUDA graphs (~1-2 GiB)."""

ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_parameters(cfg: DecoderConfig) -> int:
    """Parameters of a model of ``cfg``: every layer, its routed experts, embeddings and head."""
    layers = sum(layer_parameters(cfg, t, i) for i, t in enumerate(cfg.layer_types))
    experts = sum(moe.expert_parameters(cfg, i) for i in range(len(cfg.layer_types)))
    return layers + experts + root_parameters(cfg)


@dataclass(frozen=True)
class EngineNeeds:
    """One engine's memory per GPU (bytes) and the sequences its KV cache holds (module docstring)."""

    gpus: int
    weights: float
    runtime: float
    kv_cache: float
    kv_per_token: float
    state_per_sequence: float
    sample_context: int
    sequences: int

    @property
    def fits(self) -> bool:
        """Whether one sequence of ``sample_context`` tokens fits (vLLM starts)."""
        return self.sequences >= 1


def engine_needs(
    cfg: DecoderConfig, *, gpus: int, gpu_memory: int, dtype: str, sample_context: int, utilization: float
) -> EngineNeeds:
    """What an engine of ``gpus`` GPUs of ``gpu_memory`` bytes needs per GPU for ``cfg`` in ``dtype`` and how many
    sequences of ``sample_context`` tokens its KV cache holds (module docstring). UserInputError for an unknown
    dtype or a utilization outside (0, 1]."""
    if dtype not in ENGINE_DTYPE_BYTES:
        raise UserInputError(f"--vllm-dtype={dtype!r}: choose one of {', '.join(ENGINE_DTYPE_BYTES)}")
    if not 0 < utilization <= 1:
        raise UserInputError(f"--vllm-memory-utilization={utilization}: must be in (0, 1]")
    b = ENGINE_DTYPE_BYTES[dtype]
    types = cfg.layer_types or ("full_attention",) * cfg.num_layers
    full = sum(t == "full_attention" for t in types)
    linear = len(types) - full
    kv_per_token = full * 2 * math.ceil(cfg.num_kv_heads / gpus) * cfg.head_dim * b
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    recurrent = cfg.linear_num_value_heads * dk * dv
    conv = (cfg.linear_conv_kernel_dim - 1) * (2 * cfg.linear_num_key_heads * dk + cfg.linear_num_value_heads * dv)
    state = linear * (recurrent + conv) * b / gpus
    weights = model_parameters(cfg) * b / gpus
    kv_cache = max(0.0, utilization * gpu_memory - weights - ENGINE_RUNTIME_BYTES)
    per_sequence = sample_context * kv_per_token + state
    return EngineNeeds(
        gpus=gpus,
        weights=weights,
        runtime=ENGINE_RUNTIME_BYTES,
        kv_cache=kv_cache,
        kv_per_token=kv_per_token,
        state_per_sequence=state,
        sample_context=sample_context,
        sequences=int(kv_cache // per_sequence) if per_sequence else 0,
    )


@dataclass(frozen=True)
class Split:
    """``engines`` engines of ``needs.gpus`` GPUs each, the other ``training_gpus`` training; ``training``: the
    best training layout on them (None: no layout at that count)."""

    engines: int
    training_gpus: int
    ranks_per_node: int
    engine_gpus_per_node: int
    needs: EngineNeeds
    training: Planned | None

    @property
    def sequences(self) -> int:
        """Sequences of ``needs.sample_context`` tokens all engines' KV caches hold at once."""
        return self.engines * self.needs.sequences

    @property
    def training_fits(self) -> bool:
        return self.training is not None and self.training.fits

    def as_dict(self) -> dict:
        training = None if self.training is None else {**self.training.estimate.as_dict(), "fits": self.training.fits}
        return {
            "engines": self.engines,
            "engine_gpus": self.engines * self.needs.gpus,
            "training_gpus": self.training_gpus,
            "ranks_per_node": self.ranks_per_node,
            "engine_gpus_per_node": self.engine_gpus_per_node,
            "sequences": self.sequences,
            "engine": asdict(self.needs),
            "training": training,
        }


def plan_splits(
    cfg: DecoderConfig,
    *,
    gpus: int,
    gpus_per_node: int,
    gpu_memory: int,
    context: int,
    engine_gpus: int,
    engine_dtype: str,
    sample_context: int,
    utilization: float,
    engines: int | None = None,
    **layout_options: object,
) -> list[Split]:
    """Every split of ``gpus`` (``gpus_per_node`` per node) between engines of ``engine_gpus`` GPUs and training
    ranks (``engines`` given: that count only), fewest engines first; ``layout_options`` go to
    :func:`~ringtune.plan.search.plan_layouts` (precisions, recompute, sampler_snapshots, image_tokens).
    UserInputError, naming the flag, for node counts that do not divide, an engine larger than a node, or an
    engine count no node layout allows."""
    if gpus_per_node < 1 or gpus % gpus_per_node:
        raise UserInputError(f"--gpus-per-node={gpus_per_node}: must be >= 1 and divide --gpus={gpus}")
    if not 1 <= engine_gpus <= gpus_per_node - 1:
        raise UserInputError(
            f"--vllm-tp={engine_gpus}: an engine's GPUs lie on one node beside at least one training rank, so "
            f"1 <= --vllm-tp <= --gpus-per-node - 1 = {gpus_per_node - 1}"
        )
    nodes = gpus // gpus_per_node
    per_node_max = (gpus_per_node - 1) // engine_gpus
    counts = [nodes * k for k in range(1, per_node_max + 1)]
    if engines is not None:
        if engines not in counts:
            raise UserInputError(
                f"--vllm-engines={engines}: with {nodes} node(s) of {gpus_per_node} GPUs and engines of "
                f"--vllm-tp={engine_gpus} GPUs, choose one of {counts} (the same number per node, a rank left on each)"
            )
        counts = [engines]
    needs = engine_needs(
        cfg,
        gpus=engine_gpus,
        gpu_memory=gpu_memory,
        dtype=engine_dtype,
        sample_context=sample_context,
        utilization=utilization,
    )
    out = []
    for count in counts:
        per_node = count // nodes * engine_gpus
        training_gpus = gpus - count * engine_gpus
        layouts = plan_layouts(cfg, context=context, gpus=training_gpus, memory=gpu_memory, **layout_options)  # type: ignore[arg-type]
        out.append(
            Split(count, training_gpus, gpus_per_node - per_node, per_node, needs, layouts[0] if layouts else None)
        )
    return out


def recommended(splits: list[Split], sequences: int) -> Split | None:
    """The fewest engines that hold ``sequences`` sequences in all with a training layout that fits (None: no
    split does)."""
    good = [s for s in splits if s.needs.fits and s.training_fits and s.sequences >= sequences]
    return min(good, key=lambda s: s.engines) if good else None


def format_splits(splits: list[Split], best: Split | None) -> str:
    """A plain-text table of ``splits`` (GiB per GPU), ``best`` marked."""
    header = ["engines", "eng GPUs", "train GPUs", "per node", "train layout", "train peak", "fits", "seqs", ""]
    rows = [header]
    for s in splits:
        t = s.training
        layout = "-" if t is None else f"CP{t.estimate.layout.cp}xDP{t.estimate.layout.dp} {t.estimate.layout.shard}"
        layout += "" if t is None else f" {t.estimate.layout.recompute} {t.estimate.layout.precision}"
        fit = "no" if t is None else ("yes" if t.fits_with_margin else ("tight" if t.fits else "no"))
        rows.append(
            [
                str(s.engines),
                str(s.engines * s.needs.gpus),
                str(s.training_gpus),
                f"{s.ranks_per_node} ranks + {s.engine_gpus_per_node}",
                layout,
                "-" if t is None else f"{t.estimate.peak / GIB:.1f}",
                fit,
                str(s.sequences),
                "<- recommended" if s is best else "",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def describe_engine(needs: EngineNeeds, dtype: str, gpu_memory: int, utilization: float) -> str:
    """One line: an engine's memory per GPU and what its KV cache holds."""
    return (
        f"engine ({needs.gpus} GPU(s), {dtype}) per GPU: weights {needs.weights / GIB:.1f} GiB + runtime "
        f"{needs.runtime / GIB:.1f} GiB + KV cache {needs.kv_cache / GIB:.1f} GiB (= {utilization:.0%} of "
        f"{gpu_memory / GIB:.1f} GiB minus the rest); KV {needs.kv_per_token / 2**10:.1f} KiB/token + state "
        f"{needs.state_per_sequence / 2**20:.1f} MiB/sequence -> {needs.sequences} sequence(s) of "
        f"{needs.sample_context} tokens per engine"
    )
