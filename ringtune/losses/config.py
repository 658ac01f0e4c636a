"""Which Tinker loss a request asks for, its config, and the per-datum inputs it must carry.

Everything here runs where a request enters (the engine, before any forward), and raises
:class:`~ringtune.errors.UserInputError` naming the field, the value and what is allowed. See
docs/protocol.md ("Losses") for the losses and their SDK names.

Choices this module makes (the SDK and the docs leave them open):

- ``loss_fn_config`` keys are checked per loss: ppo / cispo / gspo take ``clip_low_threshold`` and
  ``clip_high_threshold``, dro takes ``beta``, cross_entropy and importance_sampling take none. Any
  other key is an error (a typo must not silently train with a default).
- Defaults: ppo and gspo clip to [0.8, 1.2] (thresholds on the ratio itself, not epsilons), cispo
  to [0.0, 4.0], dro ``beta = 0.05`` (the docs' example value; the service documents none).
  Thresholds must satisfy ``0 <= low <= high``; ``beta >= 0``; every value finite.
- ``loss_fn_inputs`` may hold only keys the SDK knows (``INPUT_KEYS``). Known keys a loss does not
  use are accepted and ignored (the client-side custom path sends cross_entropy with whatever the
  user's datums carried); the cookbook's ``mask`` is accepted and ignored.
- Per-token ``clip_low_threshold`` / ``clip_high_threshold`` tensors override the config thresholds
  token by token for ppo, cispo and gspo (ignored by the other losses).
- ``target_tokens`` must be an integer tensor of token ids >= 0 (the vocab bound is the model's to
  check), shape ``[N]``, or ``[N, K]`` (K >= 1) for cross_entropy and importance_sampling
  (:data:`TARGET_K_LOSSES`), whose per-target keys (:data:`PER_TARGET_KEYS`: cross_entropy's
  ``weights``, importance_sampling's ``logprobs`` and ``advantages``) must then be ``[N, K]`` as well.
  Every other key is ``[N]``.
- Defaults of optional keys (:func:`input_default`): per-token thresholds take the config value;
  ``mask`` (carried by the cookbook's RL datums, used by no loss) is 1. A required key has no default.
- ``stable_reinforce`` (ringtune's definition, docs/losses.md) takes ``token_ratio_low`` /
  ``token_ratio_high`` (default 0.5 / 2.0), ``sequence_ratio_low`` / ``sequence_ratio_high`` (default 0.5 / 2.0)
  and ``kl_coef`` (default 0). Each band must hold 1 (``0 <= low <= 1 <= high``): an on-policy token is never
  masked. Its ``logprobs`` and ``sampled_mask`` are not the client's: the gateway resolves the datum's
  provenance spans against the sampler's records (:mod:`ringtune.gateway.stability_records`) and sets them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real

import torch

from ringtune.errors import UserInputError

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
"""The built-in Tinker losses ringtune computes."""

_REJECTED_LOSS_FNS = {
    "custom": (
        "server-side uploaded losses are not supported; use forward_backward_custom (the SDK's "
        "client-side path), which sends cross_entropy"
    ),
}

CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")

CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": CLIP_KEYS,
    "cispo": CLIP_KEYS,
    "gspo": CLIP_KEYS,
    "dro": ("beta",),
    "stable_reinforce": (
        "token_ratio_low",
        "token_ratio_high",
        "sequence_ratio_low",
        "sequence_ratio_high",
        "kl_coef",
    ),
}
"""The ``loss_fn_config`` keys each loss accepts."""

STABLE_REINFORCE_DEFAULTS: dict[str, float] = {
    "token_ratio_low": 0.5,
    "token_ratio_high": 2.0,
    "sequence_ratio_low": 0.5,
    "sequence_ratio_high": 2.0,
    "kl_coef": 0.0,
}
"""``stable_reinforce``'s ``loss_fn_config`` defaults (ringtune's choice; hosted Tinker publishes none)."""

CLIP_DEFAULTS: dict[str, tuple[float, float]] = {"ppo": (0.8, 1.2), "gspo": (0.8, 1.2), "cispo": (0.0, 4.0)}
"""Default ``(clip_low_threshold, clip_high_threshold)`` of the clipped losses."""

DRO_DEFAULT_BETA = 0.05
"""dro's ``beta`` when the request gives none (the Tinker docs' example value; the service documents none)."""

INPUT_KEYS = (
    "target_tokens",
    "weights",
    "logprobs",
    "advantages",
    "sequence_ratio_mask",
    "clip_low_threshold",
    "clip_high_threshold",
    "mask",
    "sampled_mask",
)
"""Every ``loss_fn_inputs`` key the engine takes; any other key is refused. ``sampled_mask`` is set by the gateway
from a datum's provenance spans (1 at loss rows a ``SampledProvenanceSpan`` covers), never taken from a client."""

SERVER_INPUT_KEYS = ("sampled_mask",)
"""Keys only the gateway sets (from provenance); a client that sends one is refused at the gateway."""

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

TARGET_K_LOSSES = ("cross_entropy", "importance_sampling")
"""Losses that take ``[N, K]`` targets (K candidate targets per position, e.g. top-k distillation)."""

FIXED_GRADIENT_LOSSES = ("cross_entropy",)
"""Losses whose gradient in the log-probs does not depend on the log-probs (``-w·lp`` gives ``-w``), so it is
known before the forward and the log-prob head may make its gradients in its forward pass. The others do
depend on them: importance_sampling, ppo and gspo through ``exp(lp - q)``, cispo through the clipped ratio's
value, dro through ``lp - q``."""

PER_TARGET_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
}
"""Keys shaped like ``target_tokens`` (``[N]`` or ``[N, K]``); every other key is ``[N]``."""


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """A resolved loss choice. Build with :func:`parse_loss_config`.

    Attributes:
        loss_fn: one of :data:`LOSS_FNS`.
        clip_low, clip_high: ratio thresholds of ppo / cispo / gspo (None for the other losses).
        beta: dro's quadratic penalty weight (None for the other losses).
        token_band, sequence_band: stable_reinforce's ``(low, high)`` ratio bands (None for the other losses).
        kl_coef: stable_reinforce's weight of ``1/2 (lp - q)^2`` on sampled rows (None for the other losses).
    """

    loss_fn: str
    clip_low: float | None = None
    clip_high: float | None = None
    beta: float | None = None
    token_band: tuple[float, float] | None = None
    sequence_band: tuple[float, float] | None = None
    kl_coef: float | None = None


def check_loss_fn(loss_fn: str) -> str:
    """Return ``loss_fn`` if ringtune computes it, else raise :class:`UserInputError` with the allowed set."""
    if isinstance(loss_fn, str) and loss_fn in LOSS_FNS:
        return loss_fn
    why = _REJECTED_LOSS_FNS.get(loss_fn) if isinstance(loss_fn, str) else None
    allowed = ", ".join(LOSS_FNS)
    if why:
        raise UserInputError(f"loss_fn={loss_fn!r} is not supported: {why} (supported: {allowed})")
    raise UserInputError(f"loss_fn={loss_fn!r} is not a supported loss; choose one of: {allowed}")


def parse_loss_config(loss_fn: str, config: Mapping[str, float] | None) -> LossConfig:
    """Resolve a request's ``loss_fn`` and ``loss_fn_config`` into a :class:`LossConfig`.

    Args:
        loss_fn: the request's loss name.
        config: the request's ``loss_fn_config`` (numbers only), or None / empty for the defaults.
    Raises:
        UserInputError: unknown loss (incl. ``custom``), a key the loss does
            not take, a value that is not a finite real number, ``low > high``, ``low < 0`` or ``beta < 0``.
    """
    loss_fn = check_loss_fn(loss_fn)
    allowed = CONFIG_KEYS[loss_fn]
    values: dict[str, float] = {}
    for key, value in (config or {}).items():
        if key not in allowed:
            takes = f"takes only {', '.join(allowed)}" if allowed else "takes no loss_fn_config keys"
            raise UserInputError(f"loss_fn_config[{key!r}]={value!r}: loss_fn={loss_fn!r} {takes}")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
            raise UserInputError(f"loss_fn_config[{key!r}]={value!r} must be a finite real number")
        values[key] = float(value)
    if loss_fn in CLIP_DEFAULTS:
        low = values.get("clip_low_threshold", CLIP_DEFAULTS[loss_fn][0])
        high = values.get("clip_high_threshold", CLIP_DEFAULTS[loss_fn][1])
        if low < 0:
            raise UserInputError(f"loss_fn_config['clip_low_threshold']={low} must be >= 0 (a ratio threshold)")
        if low > high:
            raise UserInputError(
                f"loss_fn_config clip_low_threshold={low} > clip_high_threshold={high}; the ratio clip range "
                f"needs low <= high (thresholds are on the ratio itself, e.g. 0.8 and 1.2)"
            )
        return LossConfig(loss_fn=loss_fn, clip_low=low, clip_high=high)
    if loss_fn == "dro":
        beta = values.get("beta", DRO_DEFAULT_BETA)
        if beta < 0:
            raise UserInputError(f"loss_fn_config['beta']={beta} must be >= 0")
        return LossConfig(loss_fn=loss_fn, beta=beta)
    if loss_fn == "stable_reinforce":
        return _stable_reinforce_config(values)
    return LossConfig(loss_fn=loss_fn)


def _stable_reinforce_config(values: Mapping[str, float]) -> LossConfig:
    """stable_reinforce's bands (each ``0 <= low <= 1 <= high``) and ``kl_coef >= 0``, defaults filled in."""
    full = {**STABLE_REINFORCE_DEFAULTS, **values}
    bands = []
    for name in ("token", "sequence"):
        low, high = full[f"{name}_ratio_low"], full[f"{name}_ratio_high"]
        if not 0 <= low <= 1 <= high:
            raise UserInputError(
                f"loss_fn_config {name}_ratio_low={low}, {name}_ratio_high={high}: the band must hold the "
                f"on-policy ratio 1 (0 <= low <= 1 <= high)"
            )
        bands.append((low, high))
    if full["kl_coef"] < 0:
        raise UserInputError(f"loss_fn_config['kl_coef']={full['kl_coef']} must be >= 0")
    return LossConfig(loss_fn="stable_reinforce", token_band=bands[0], sequence_band=bands[1], kl_coef=full["kl_coef"])


def required_inputs(loss_fn: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` keys every datum of ``loss_fn`` must carry."""
    loss_fn = check_loss_fn(loss_fn)
    if loss_fn == "cross_entropy":
        return ("target_tokens", "weights")
    if loss_fn == "gspo":
        return (*_RL_INPUTS, "sequence_ratio_mask")
    if loss_fn == "stable_reinforce":
        return (*_RL_INPUTS, "sampled_mask")
    return _RL_INPUTS


def used_inputs(loss_fn: str) -> tuple[str, ...]:
    """The keys ``loss_fn`` reads: its required keys, then the optional per-token thresholds of clipped losses."""
    loss_fn = check_loss_fn(loss_fn)
    optional = CLIP_KEYS if loss_fn in CLIP_DEFAULTS else ()
    return (*required_inputs(loss_fn), *optional)


def input_default(config: LossConfig, key: str) -> float:
    """The value a datum that does not send optional key ``key`` behaves as if it had sent, token by token.

    ``clip_low_threshold`` / ``clip_high_threshold``: the config threshold; ``mask``: 1 (no loss reads it).
    Raises UserInputError for a key that has no default (a required key of the loss, or an unknown key).
    """
    if key in CLIP_KEYS and config.clip_low is not None and config.clip_high is not None:
        return config.clip_low if key == "clip_low_threshold" else config.clip_high
    if key == "mask":
        return 1.0
    raise UserInputError(f"loss_fn_inputs[{key!r}] has no default for loss_fn={config.loss_fn!r}; every datum sends it")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check_datum_inputs(loss_fn: str, index: int, n_tokens: int, inputs: Mapping[str, torch.Tensor]) -> None:
    """Check one datum's ``loss_fn_inputs`` against ``loss_fn`` (see the module docstring for the rules).

    Args:
        loss_fn: the request's loss name.
        index: the datum's index in the request (for the message).
        n_tokens: N, the datum's ``model_input`` length (one loss position per input token).
        inputs: the decoded tensors (dense; CSR already expanded).
    Raises:
        UserInputError: naming the datum index, the field, its shape (or value) and what was expected.
    """
    loss_fn = check_loss_fn(loss_fn)
    where = f"datum {index} (loss_fn={loss_fn!r}, {n_tokens} model_input tokens)"
    for key in inputs:
        if key not in INPUT_KEYS:
            raise UserInputError(f"{where}: unknown loss_fn_inputs key {key!r}; known keys: {', '.join(INPUT_KEYS)}")
    missing = [key for key in required_inputs(loss_fn) if key not in inputs]
    if missing:
        raise UserInputError(
            f"{where}: loss_fn_inputs lacks {', '.join(missing)}; {loss_fn} needs "
            f"{', '.join(required_inputs(loss_fn))} (got {', '.join(inputs) or 'none'})"
        )
    targets = inputs["target_tokens"]
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise UserInputError(f"{where}: loss_fn_inputs['target_tokens'] has dtype {targets.dtype}, expected int64 ids")
    two_d = targets.dim() == 2 and targets.shape[0] == n_tokens and targets.shape[1] >= 1
    if two_d and loss_fn not in TARGET_K_LOSSES:
        raise UserInputError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {_shape(targets)}; [N, K] targets are only for "
            f"{' and '.join(TARGET_K_LOSSES)}, {loss_fn} expects [{n_tokens}]"
        )
    if not (two_d or _shape(targets) == [n_tokens]):
        expected = f"[{n_tokens}] or [{n_tokens}, K]" if loss_fn in TARGET_K_LOSSES else f"[{n_tokens}]"
        raise UserInputError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {_shape(targets)}, expected {expected} "
            f"(one target per model_input token)"
        )
    if targets.numel() and int(targets.min()) < 0:
        raise UserInputError(f"{where}: loss_fn_inputs['target_tokens'] holds {int(targets.min())}; ids must be >= 0")
    for key, t in inputs.items():
        if key == "target_tokens":
            continue
        per_target = key in PER_TARGET_KEYS.get(loss_fn, ())
        expected_shape = _shape(targets) if per_target else [n_tokens]
        if _shape(t) != expected_shape:
            note = " (the shape of target_tokens)" if per_target else " (one value per model_input token)"
            raise UserInputError(
                f"{where}: loss_fn_inputs[{key!r}] has shape {_shape(t)}, expected {expected_shape}{note}"
            )
        if t.dtype.is_complex or t.dtype == torch.bool:
            raise UserInputError(f"{where}: loss_fn_inputs[{key!r}] has dtype {t.dtype}, expected float32")
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            bad = tuple(int(i) for i in (~torch.isfinite(t)).nonzero()[0])
            raise UserInputError(
                f"{where}: loss_fn_inputs[{key!r}][{', '.join(map(str, bad))}]={float(t[bad])} is not finite; "
                f"every value must be finite"
            )
    for key in CLIP_KEYS:
        if key in inputs and inputs[key].numel() and float(inputs[key].min()) < 0:
            raise UserInputError(f"{where}: loss_fn_inputs[{key!r}] holds {float(inputs[key].min())}; must be >= 0")
    if all(key in inputs for key in CLIP_KEYS):
        above = inputs["clip_low_threshold"] > inputs["clip_high_threshold"]
        if bool(above.any()):
            at = int(above.nonzero()[0, 0])
            raise UserInputError(
                f"{where}: loss_fn_inputs clip_low_threshold[{at}]={float(inputs['clip_low_threshold'][at])} > "
                f"clip_high_threshold[{at}]={float(inputs['clip_high_threshold'][at])}; needs low <= high"
            )
