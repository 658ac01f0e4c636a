"""Tinker's built-in losses on CP shards: config and input checks, per-token terms, the plain reference."""

from ringtune.losses.config import (
    CLIP_KEYS,
    CONFIG_KEYS,
    DRO_DEFAULT_BETA,
    FIXED_GRADIENT_LOSSES,
    INPUT_KEYS,
    LOSS_FNS,
    PER_TARGET_KEYS,
    SERVER_INPUT_KEYS,
    STABLE_REINFORCE_DEFAULTS,
    TARGET_K_LOSSES,
    LossConfig,
    check_datum_inputs,
    check_loss_fn,
    input_default,
    parse_loss_config,
    required_inputs,
    used_inputs,
)
from ringtune.losses.metrics import loss_metrics, stable_reinforce_metrics
from ringtune.losses.reference import reference_datum_losses, reference_losses, sequence_log_ratio
from ringtune.losses.token_losses import datum_mean_log_ratio, fixed_logprob_gradient, local_token_losses

__all__ = [
    "CLIP_KEYS",
    "CONFIG_KEYS",
    "DRO_DEFAULT_BETA",
    "FIXED_GRADIENT_LOSSES",
    "INPUT_KEYS",
    "LOSS_FNS",
    "PER_TARGET_KEYS",
    "SERVER_INPUT_KEYS",
    "STABLE_REINFORCE_DEFAULTS",
    "TARGET_K_LOSSES",
    "LossConfig",
    "check_datum_inputs",
    "check_loss_fn",
    "datum_mean_log_ratio",
    "fixed_logprob_gradient",
    "input_default",
    "local_token_losses",
    "loss_metrics",
    "parse_loss_config",
    "reference_datum_losses",
    "reference_losses",
    "required_inputs",
    "sequence_log_ratio",
    "stable_reinforce_metrics",
    "used_inputs",
]
