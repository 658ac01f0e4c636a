"""Every layout of a GPU count, its predicted peak, and the layouts that fit, best first.

A layout is CP·DP = GPUs (CP a divisor of the GPU count that the model's heads allow with the default CP
modes: ring attention, headwise GatedDeltaNet when CP divides its heads, else chunkwise), a parameter sharding
(:func:`shardings`: replicated; FSDP2 over DP when DP > 1; FSDP2 over DP·CP when CP > 1), a recompute mode
and a precision.
Order: layouts that fit with :data:`MARGIN` of the GPU memory free first, then those that fit at all; within
each, the highest throughput proxy (:func:`throughput_cost`, lowest first), then the most memory left. Layouts
that do not fit follow, smallest peak first (the nearest to fitting).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtune.errors import UserInputError
from ringtune.layout.budget import rank_token_budget
from ringtune.models.config import DecoderConfig
from ringtune.models.recompute import RECOMPUTE_MODES
from ringtune.plan.estimate import PRECISIONS, Estimate, Layout, check_precision_planned, estimate
from ringtune.plan.moe import ep_sizes
from ringtune.plan.vision import check_image_tokens

MARGIN = 0.10
"""Fraction of the GPU memory a layout should leave free (allocator fragmentation, CUDA context, NCCL)."""

RECOMPUTE_COST = {"none": 1.0, "selective": 1.25, "full": 1.33}
"""Compute per step relative to ``none``: a forward is ~1/3 of forward+backward; ``full`` reruns it whole,
``selective`` reruns all but the attention core (the GDN layers, the projections and MLPs: ~3/4 of it)."""

PRECISION_COST = {"bf16-mixed": 1.0, "bfloat16": 1.0, "float32": 2.0}
"""bf16 matmuls run at least twice float32's rate on current GPUs (TF32 aside)."""

PAD_MULTIPLIER = 8
"""The per-rank stream's pad multiple (``ringtune serve``'s budget)."""


@dataclass(frozen=True)
class Planned:
    """A layout's estimate and whether it fits ``memory`` bytes per GPU (and with the margin)."""

    estimate: Estimate
    memory: int
    fits: bool
    fits_with_margin: bool
    cost: float

    @property
    def free(self) -> float:
        return self.memory - self.estimate.peak


def throughput_cost(layout: Layout) -> float:
    """A proxy of seconds per token (lower is better): recompute and precision cost, plus CP's communication
    share (each doubling of CP adds 5%: ring and all-to-all traffic per token grow with (CP-1)/CP)."""
    cp_share = 1 + 0.05 * (layout.cp.bit_length() - 1)
    return RECOMPUTE_COST[layout.recompute] * PRECISION_COST[layout.precision] * cp_share


def check_positive(field: str, value: int | float, limit: str = "> 0") -> None:
    if not value > 0:
        raise UserInputError(f"{field}={value}: must be {limit}")


def cp_sizes(cfg: DecoderConfig, gpus: int, context: int) -> list[int]:
    """CP sizes that divide ``gpus`` and leave every rank at least one GDN chunk's worth of tokens."""
    sizes = [c for c in range(1, gpus + 1) if gpus % c == 0]
    return [c for c in sizes if context // c >= 64 or c == 1]


def shardings(cp: int, dp: int) -> tuple[str, ...]:
    """The distinct shardings of a CP x DP layout: ``none``; ``dp`` when DP > 1; ``dp_cp`` when CP > 1 (at CP 1
    it is ``dp``, at DP 1 ``dp`` shards nothing)."""
    return ("none",) + (("dp",) if dp > 1 else ()) + (("dp_cp",) if cp > 1 else ())


def expert_layouts(cfg: DecoderConfig, ranks: int) -> list[tuple[str, int]]:
    """(sharding, EP) of the expert-parallel layouts of ``ranks`` DP·CP ranks: each EP size replicated, and with
    ``dp_cp`` FSDP where each EP rank's experts split evenly over its ranks/EP expert replicas."""
    out = []
    for ep in ep_sizes(cfg, ranks)[1:]:
        out.append(("none", ep))
        if (cfg.num_experts // ep) % (ranks // ep) == 0:
            out.append(("dp_cp", ep))
    return out


def plan_layouts(
    cfg: DecoderConfig,
    *,
    context: int,
    gpus: int,
    memory: int,
    precisions: tuple[str, ...] = tuple(PRECISIONS),
    recompute: tuple[str, ...] = RECOMPUTE_MODES,
    sampler_snapshots: int = 0,
    image_tokens: int = 0,
) -> list[Planned]:
    """Every layout for ``context`` tokens per row on ``gpus`` GPUs of ``memory`` bytes, best first, each rank also
    holding ``sampler_snapshots`` whole sampler snapshots (:func:`~ringtune.plan.estimate.snapshot_bytes`);
    ``image_tokens`` of each row's tokens are image-pad tokens (a vision-language model:
    :mod:`ringtune.plan.vision`)."""
    check_positive("--context-length", context)
    check_positive("--gpus", gpus)
    check_positive("--gpu-memory", memory)
    check_image_tokens(cfg, image_tokens, context)
    for p in precisions:
        check_precision_planned(p, "--precision")
    for r in recompute:
        if r not in RECOMPUTE_MODES:
            raise UserInputError(f"--recompute={r!r}: choose from {', '.join(RECOMPUTE_MODES)}")
    out = []
    for cp in cp_sizes(cfg, gpus, context):
        dp = gpus // cp
        tokens = rank_token_budget(context, cp, pad_multiplier=PAD_MULTIPLIER)
        for shard, ep in [(s, 1) for s in shardings(cp, dp)] + expert_layouts(cfg, cp * dp):
            for rc in recompute:
                for precision in precisions:
                    layout = Layout(cp=cp, dp=dp, shard=shard, recompute=rc, precision=precision, ep=ep)
                    est = estimate(cfg, layout, tokens, sampler_snapshots=sampler_snapshots, image_tokens=image_tokens)
                    out.append(planned_of(est, memory))
    return ranked(out)


def planned_of(est: Estimate, memory: float) -> Planned:
    """``est`` judged against ``memory`` bytes per GPU: fits, fits with :data:`MARGIN`, throughput cost."""
    return Planned(
        estimate=est,
        memory=memory,
        fits=est.peak <= memory,
        fits_with_margin=est.peak <= (1 - MARGIN) * memory,
        cost=throughput_cost(est.layout),
    )


def ranked(planned: list[Planned]) -> list[Planned]:
    """``planned`` in the order :func:`plan_layouts` gives: fitting with margin first, then cheapest, then most
    memory left (sorted in place and returned)."""
    planned.sort(key=lambda p: (not p.fits_with_margin, not p.fits, p.cost if p.fits else 0.0, -p.free))
    return planned
