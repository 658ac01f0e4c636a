"""Wire values -> engine types, and tinker:// paths. Every bad value raises UserInputError naming field/value/limit."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum
from ringtune.errors import UserInputError
from ringtune.gateway.image_chunks import expand_images
from ringtune.gateway.images import ImageDecoder, PatchBudget
from ringtune.gateway.paths import KINDS, check_name, check_run_id
from ringtune.gateway.proto import ForwardBackwardCall
from ringtune.losses import SERVER_INPUT_KEYS
from ringtune.models.lora import LoraSpec

TINKER_SCHEME = "tinker://"
ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def train_data(call: ForwardBackwardCall, images: ImageDecoder | None = None) -> list[TrainDatum]:
    """The call's datums as engine ``TrainDatum``s (tokens int64 [N]; inputs as decoded, float32 / int64).

    ``images``: the served checkpoint's image decoder (None: a text-only model, image chunks refused); each
    datum's image chunks are decoded and expanded into image-pad tokens (:mod:`ringtune.gateway.image_chunks`),
    so ``tokens`` and ``images`` are what the model takes. Only structure is checked here (at least one datum, no
    key only the server sets: ``sampled_mask``, the images); shapes, ids and finiteness are the engine's to check
    (:func:`ringtune.losses.check_datum_inputs`), before it computes anything. Provenance spans are not read here
    (:mod:`ringtune.gateway.provenance`).
    """
    if not call.data:
        raise UserInputError("forward_backward_input.data: the request holds no datums; send at least 1")
    for i, d in enumerate(call.data):
        for key in SERVER_INPUT_KEYS:
            if key in d.inputs:
                raise UserInputError(
                    f"data[{i}].loss_fn_inputs[{key!r}]: set by the server from the datum's provenance spans, "
                    f"never sent by a client"
                )
    budget = PatchBudget(images.limits.max_request_patches) if images is not None else None
    data = []
    for i, d in enumerate(call.data):
        tokens, inputs = expand_images(d.tokens, d.images, images, budget, f"data[{i}].model_input")
        data.append(
            TrainDatum(
                tokens=torch.from_numpy(tokens),
                inputs={k: torch.from_numpy(v) for k, v in d.inputs.items()},
                images=inputs,
            )
        )
    return data


def loss_config(config: Mapping[str, float | str]) -> dict[str, float] | None:
    """Numeric ``loss_fn_config`` for the engine (None when empty); text values (v2 only) are refused."""
    out: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, str):
            raise UserInputError(
                f"loss_fn_config[{key!r}]={value!r}: text values are not supported by any loss here; send a number"
            )
        out[key] = float(value)
    return out or None


def adam_params(body: Mapping[str, Any] | None, *, field: str = "adam_params") -> AdamParams:
    """``AdamParams`` from the wire's ``adam_params`` object, validated (SDK defaults for absent fields).

    Raises UserInputError for a non-Adam ``type`` (e.g. dimuon), an unknown key, a non-number or a value out
    of range (the engine's :meth:`AdamParams.validate`).
    """
    if body is None:
        raise UserInputError(f"{field}: missing; optim_step needs adam_params ({', '.join(ADAM_FIELDS)})")
    values: dict[str, float] = {}
    for key, value in body.items():
        if key == "type":
            if value not in ("adam", "adamw"):
                raise UserInputError(f"{field}.type={value!r}: only AdamW is supported (optimizer_config type 'adamw')")
            continue
        if key not in ADAM_FIELDS:
            raise UserInputError(f"{field}.{key}: unknown field; AdamParams has {', '.join(ADAM_FIELDS)}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserInputError(f"{field}.{key}={value!r} must be a number")
        values[key] = float(value)
    params = AdamParams(**values)
    params.validate()
    return params


def lora_spec(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``create_model``'s ``lora_config`` as a run's LoRA spec (:class:`~ringtune.models.lora.LoraSpec` dict), or
    None for full fine-tuning (no lora_config, or rank 0: the gateway's convention). A missing seed is drawn here,
    once, so every rank initialises the same adapters and the run's record can recreate them.
    UserInputError naming the field, value and limit."""
    if config is None or config.get("rank") == 0:
        return None
    seed = config.get("seed")
    values = {k: config[k] for k in ("rank", "train_attn", "train_mlp", "train_unembed") if k in config}
    spec = LoraSpec(**values, seed=secrets.randbits(63) if seed is None else seed).validate()
    return spec.to_dict()


def check_optimizer_config(config: Mapping[str, Any] | None) -> None:
    """``optimizer_config.type`` must be ``adamw`` (the SDK default) when given."""
    if config is not None and config.get("type", "adamw") != "adamw":
        raise UserInputError(f"optimizer_config.type={config.get('type')!r}: only 'adamw' is supported")


def metadata_strings(field: str, metadata: Mapping[str, Any] | None, *, max_bytes: int = 65536) -> dict[str, str]:
    """``user_metadata`` as ``{str: str}`` (what ``TrainingRun`` returns): non-string values JSON-encoded."""
    if metadata is None:
        return {}
    out = {str(k): v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}
    size = sum(len(k) + len(v) for k, v in out.items())
    if size > max_bytes:
        raise UserInputError(f"{field}: {size} bytes of metadata; the limit is {max_bytes}")
    return out


def check_seq_id(seq_id: int | None) -> int:
    """A training op's ``seq_id``: an int >= 1 (the SDK counts 1, 2, ... per model)."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
        raise UserInputError(f"seq_id={seq_id!r} must be an integer >= 1 (the per-model request counter)")
    return seq_id


def check_ttl(ttl_seconds: int | None) -> int | None:
    """``ttl_seconds``: None (never expires) or 3600 .. 10 years, as the SDK documents."""
    if ttl_seconds is None:
        return None
    limit = 10 * 365 * 24 * 3600
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 3600 <= ttl_seconds <= limit:
        raise UserInputError(f"ttl_seconds={ttl_seconds!r} must be between 3600 and {limit} (or omitted)")
    return ttl_seconds


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<run_id>/<kind>/<name>``; ``kind`` in ``weights`` / ``sampler_weights``."""

    run_id: str
    kind: str
    name: str

    @property
    def checkpoint_id(self) -> str:
        """``<kind>/<name>``, the SDK's checkpoint id."""
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{TINKER_SCHEME}{self.run_id}/{self.kind}/{self.name}"


def parse_tinker_path(field: str, path: object, *, kinds: tuple[str, ...] = tuple(KINDS)) -> TinkerPath:
    """Parse and check a tinker path (exactly three ``/`` segments, a known kind, a valid run id and name)."""
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise UserInputError(f"{field}={path!r} is not a tinker path (tinker://<run_id>/<kind>/<name>)")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3:
        raise UserInputError(f"{field}={path!r}: a tinker path has exactly 3 '/'-separated parts: run, kind, name")
    run_id, kind, name = parts
    if kind not in kinds:
        raise UserInputError(f"{field}={path!r}: kind {kind!r} is not one of {list(kinds)}")
    return TinkerPath(run_id=check_run_id(field, run_id), kind=kind, name=check_name(field, name))


def parse_checkpoint_id(field: str, checkpoint_id: str) -> tuple[str, str]:
    """``<kind>/<name>`` (a kind of :data:`KINDS`: weights, sampler_weights, external_weights) -> (kind, name)."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KINDS:
        raise UserInputError(f"{field}={checkpoint_id!r}: expected <kind>/<name> with a kind of {list(KINDS)}")
    return kind, check_name(field, name)
