"""The per-dtype limits of ``ringtune parity compare`` (:mod:`ringtune.parity.compare`), with their reasoning."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-dtype limits (the coarser dtype of the two dumps decides). See :data:`LIMITS` for the reasoning."""

    lp_mean: float
    lp_p99: float
    kl: float
    short_max: float
    window_ratio: float
    window_floor: float
    loss_per_token: float
    grad_norm: float
    grad_norm_later: float
    post_mean: float
    post_p99: float
    post_loss_per_token: float
    sampler_k3: float
    sampler_max: float


LIMITS: dict[str, Limits] = {
    # float64 compute, but log-probs and per-token losses cross the wire as float32: a log-prob of magnitude 4-16
    # rounds by up to 1 ulp = 4.8e-7..9.5e-7, so every log-prob figure sits at float32 rounding (2e-6 = 2-4 ulps);
    # grad norms come back as float64 JSON numbers and a CP sum differs from the CP=1 sum only in summation
    # order (~1e-15 relative): 1e-12.
    "float64": Limits(
        lp_mean=1e-6,
        lp_p99=2e-6,
        kl=1e-12,
        short_max=2e-6,
        window_ratio=4.0,
        window_floor=1e-6,
        loss_per_token=2e-6,
        grad_norm=1e-12,
        grad_norm_later=1e-10,
        post_mean=1e-6,
        post_p99=2e-6,
        post_loss_per_token=4e-6,
        sampler_k3=1e-12,
        sampler_max=2e-6,  # measured 0: decode and training forward in float64, both rounded to float32
    ),
    # float32: each CP layout sums attention blocks, GDN chunks and gradient partials in another order. Measured
    # (docs/validation-grid.md): the tiny Qwen3.5 at CP 2/4 moves log-probs by mean 5e-8, p99 4.8e-7 (1 ulp at
    # |lp| ~ 4.6); SmolLM2-135M at CP 2 (30 layers, 49K vocabulary, |lp| up to ~20 where 1 ulp is 1.9e-6) by mean
    # 2.1e-6, p99 9.5e-6, short-row max 1.7e-5, per-token loss 4.9e-5 (importance sampling, whose ratio
    # exp(lp - q) amplifies both servers' q noise). Limits ~3-5x above the real model; the smallest fault (an
    # off-by-one position on one chunk) moves the mean by 4.6e-4. Windows skip their ratio test only below 2e-6
    # (float32 rounding of a log-prob), so a state drop that lifts a split window 100x over a quiet interior
    # still fails there. Step-1 grad norm: the brief's 1e-5 (measured 8e-9); later steps 1e-4 (measured 9e-7).
    "float32": Limits(
        lp_mean=1e-5,
        lp_p99=5e-5,
        kl=1e-10,
        short_max=5e-5,
        window_ratio=4.0,
        window_floor=2e-6,
        loss_per_token=2e-5,
        grad_norm=1e-5,
        grad_norm_later=1e-4,
        post_mean=2e-5,
        post_p99=1e-4,
        post_loss_per_token=2e-4,
        # sampler KL (docs/validation-grid.md): tiny model 2-3e-14 at CP 1/2/4, SmolLM2-135M 9e-12; the off-by-one
        # fault 3.8e-6, the GDN state drop 4.4e-10 (2.9e-9 at a 512-token row budget). Max |Δ|: 9.5e-7 (1-2
        # ulps), SmolLM2 1.9e-5; the faults 1.6e-2 and 1.8e-4.
        sampler_k3=1e-10,
        sampler_max=1e-4,
    ),
    # bfloat16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per op): a different reduction order moves
    # hidden states and log-probs. Measured on the tiny Qwen3.5 at CP 2 and 4 (docs/validation-grid.md): mean |Δlp|
    # 2.2e-4, p99 1.0e-3, short-row max 1.4e-3, per-token loss 1.8e-3 (cispo), step-1 grad norm 6e-4 relative,
    # later steps 1e-3. Limits ~5x above (KL, a square, 25x); the grad-norm limit 5e-3 is the 0.2-0.3% the
    # comparable system saw from layout changes on a 4B model, with headroom. The window ratio stays 4.
    "bfloat16": Limits(
        lp_mean=1e-3,
        lp_p99=5e-3,
        kl=1e-6,
        short_max=7e-3,
        window_ratio=4.0,
        window_floor=1e-3,
        loss_per_token=2e-3,
        grad_norm=5e-3,
        grad_norm_later=1e-2,
        post_mean=2e-3,
        post_p99=7e-3,
        post_loss_per_token=1e-2,
        sampler_k3=1e-6,  # measured 2e-9 at CP 1, 6e-8 at CP 2 (bf16 decode vs bf16 packed forward)
        sampler_max=7e-3,  # measured 6.7e-4 at CP 1, 1.2e-3 at CP 2: bf16 hidden states rounded in another order
    ),
}
# bfloat16 and bf16-mixed: the fields a permutation of the datums moves come from its measured noise
# (limits_from_noise below; the CP-spread values above stay for the fields it does not move).
# bf16-exact rounds the same values to bfloat16 (so against float32 it differs by bf16 noise: compare._dtype applies
# bf16 limits then) but computes in float64 between roundings, so its CP layouts agree with its CP=1 to float32 head
# rounding, and float32's limits apply. Measured (parity matrix, tiny Qwen3.5 at 512 tokens, CP 2/4 headwise and
# chunkwise, 2026-12-06): mean |Δlp| <= 3.0e-9, p99 0, step grad-norm ratios within 1.1e-8 of 1, sampler KL k3
# 2.4e-14 (max 4.8e-7), every window below the float32 floor.
LIMITS["bf16-exact"] = LIMITS["float32"]
COARSENESS = ("float64", "float32", "bf16-exact", "bf16-mixed", "bfloat16")

NOISE_FIGURES: dict[str, Callable[[str], bool]] = {
    "lp_mean": lambda n: n == "lp.mean",
    "lp_p99": lambda n: n == "lp.p99",
    "kl": lambda n: n == "lp.trimmed_kl",
    "short_max": lambda n: n.startswith("lp.short["),
    "loss_per_token": lambda n: n == "loss.cross_entropy.per_token",
    "post_loss_per_token": lambda n: n.startswith("loss.") and n != "loss.cross_entropy.per_token",
    "grad_norm": lambda n: n == "grad_norm.cross_entropy",
    "grad_norm_later": lambda n: n.startswith("grad_norm.") and n != "grad_norm.cross_entropy",
    "post_mean": lambda n: n.startswith("lp.") and n.endswith(".mean") and n != "lp.mean",
    "post_p99": lambda n: n.startswith("lp.") and n.endswith(".p99") and n != "lp.p99",
}
"""Which compare figures each noise-derived :class:`Limits` field is measured from (:mod:`ringtune.parity.noise`)."""
MEASURED_NOISE: dict[str, dict[str, float]] = {
    # ``ringtune parity noise --dtypes bf16-mixed --cp 1 2`` and ``--dtypes bfloat16 --cp 2`` (tiny Qwen3.5,
    # 1024-token rows, CPU, 2026-12-07; docs/validation.md "Noise floors"): per field the largest value over the CP
    # sizes and permutation seeds measured. The starting-weight forwards (lp_mean .. loss_per_token) do not move:
    # on CPU a datum is computed bit-identically whatever its neighbours and place in the row (6.6e-10 is one
    # float32 ulp on a few positions); the gradient, summed over the row's tokens in another order, does, and so
    # does everything after the first step.
    "bf16-mixed": {
        "lp_mean": 6.6e-10,
        "lp_p99": 0.0,
        "kl": 0.0,
        "short_max": 4.8e-7,
        "loss_per_token": 1.6e-7,
        "post_loss_per_token": 8.0e-4,
        "grad_norm": 1.4e-5,
        "grad_norm_later": 2.6e-4,
        "post_mean": 2.8e-4,
        "post_p99": 1.22e-3,
    },
    "bfloat16": {
        "lp_mean": 6.6e-10,
        "lp_p99": 0.0,
        "kl": 0.0,
        "short_max": 4.8e-7,
        "loss_per_token": 1.3e-7,
        "post_loss_per_token": 7.0e-4,
        "grad_norm": 1.65e-4,
        "grad_norm_later": 3.3e-4,
        "post_mean": 3.6e-4,
        "post_p99": 1.27e-3,
    },
}
"""The measured spread between mathematically equal computations (:mod:`ringtune.parity.noise`), per precision."""
NOISE_FACTOR = 8.0
"""Limit = NOISE_FACTOR x the permutation floor. A CP layout reorders more than a permutation does (every attention
merge, GDN split and gradient partial, not only the order of the row's tokens in a sum): on the tiny model the honest
bf16 CP layouts' grad-norm deviations (docs/validation-grid.md: step 1 up to 4.1e-4, later steps up to 8.9e-4) are
2.5-2.7x the bfloat16 permutation floors (1.65e-4, 3.3e-4); 8 keeps 3x on top of that."""
PERMUTATION_RESOLUTION = 2e-6
"""Below this a floor means the permutation did not move the figure (float32 rounding of the wire): such a field
cannot be derived from it and keeps the CP-spread limit (:data:`LIMITS` ``bfloat16`` above)."""


def limits_from_noise(base: Limits, floors: Mapping[str, float], *, factor: float = NOISE_FACTOR) -> Limits:
    """``base`` with each :data:`NOISE_FIGURES` field whose measured floor exceeds :data:`PERMUTATION_RESOLUTION`
    set to ``factor ×`` that floor; the other fields (the permutation did not move them) keep ``base``'s value."""
    derived = {k: factor * v for k, v in floors.items() if k in NOISE_FIGURES and v > PERMUTATION_RESOLUTION}
    return replace(base, **derived)


BF16_CP_SPREAD = LIMITS["bfloat16"]
"""The bf16 limits fitted to the CP spread of honest layouts (kept for the fields no permutation moves)."""
LIMITS["bfloat16"] = limits_from_noise(BF16_CP_SPREAD, MEASURED_NOISE["bfloat16"])
LIMITS["bf16-mixed"] = limits_from_noise(BF16_CP_SPREAD, MEASURED_NOISE["bf16-mixed"])
