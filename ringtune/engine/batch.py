"""One validated batch per request: a pure function of the request, identical on every rank.

:func:`build_batch` turns a Tinker ``forward`` / ``forward_backward`` request (datums, loss name, loss config)
into a :class:`Batch` before any compute, or raises :class:`~ringtune.errors.UserInputError` naming the datum,
the field, the bad value and the limit. Rules (the loss-specific ones live in :mod:`ringtune.losses.config`):

- ``data`` is a non-empty list of :class:`TrainDatum`; each datum is self-contained: keys may differ between
  datums. Tokens and ``loss_fn_inputs`` values may be tensors, NumPy arrays or (nested) lists of numbers;
  bools and strings are not numbers. Token ids and targets are integers in ``[0, vocab)``; every datum has
  at least 1 token; float values are finite.
- ``target_tokens`` is ``[N]`` or ``[N, K]`` with ``1 <= K <= max_target_k`` (default
  :data:`MAX_TARGET_K`), the same trailing shape for every datum of a request.
- Each datum of the batch carries exactly the keys the loss reads (:func:`~ringtune.losses.used_inputs`):
  an optional key a datum omits takes its documented default (:func:`~ringtune.losses.input_default`: the
  config thresholds for per-token ``clip_*_threshold``); keys the loss does not read are validated and
  dropped; a required key that a datum omits is refused.
- The packing plan (rows per DP rank under the per-rank budget) is part of the batch.
- ``routing`` (MoE routing replay, optional, set by the gateway, never by a client): int [N, L, k], for each
  token and each of the model's L MoE layers the k experts to use, or a row of −1 (the router chooses). Checked
  against the model's ``moe_shape`` (L, k, number of experts).
- ``images`` (vision-language models; set by the gateway from the SDK's image chunks): checked against the
  tokens and the model's vision tower (:func:`~ringtune.models.vision.checks.check_images`); a model without a
  tower refuses them. Their pad tokens are part of ``tokens``, so they count in the datum's length and budget.

Values are copied (detached, contiguous, on the CPU): floats as float64 (exact for the SDK's float32), ids as
int64. The trainer moves a microbatch to its device when it runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

from ringtune.engine.packing import PackingPlan, pack_datums
from ringtune.errors import UserInputError
from ringtune.losses import (
    CLIP_KEYS,
    LossConfig,
    check_datum_inputs,
    input_default,
    parse_loss_config,
    used_inputs,
)
from ringtune.models.image_input import ImageInput
from ringtune.models.vision.checks import check_images
from ringtune.models.vision.config import VisionConfig

MAX_TARGET_K = 128
"""Default cap on K of ``[N, K]`` targets (top-k distillation uses tens); one logits pass serves all K."""

MAX_DATUMS = 65536
"""Cap on datums per request (the SDK chunks at 1024 by default)."""


@dataclass(frozen=True)
class TrainDatum:
    """One Tinker datum: ``tokens`` [N] (the model input) and its ``loss_fn_inputs`` (leading dim N).

    As a request gives it (tensors, arrays or lists); :func:`build_batch` validates and converts.
    """

    tokens: Any
    inputs: Mapping[str, Any]
    routing: Any = None
    images: tuple[ImageInput, ...] = ()
    """Images whose pad tokens ``tokens`` holds (vision-language models only), in token order."""


@dataclass(frozen=True)
class BatchDatum:
    """A validated datum: ``tokens`` int64 [N]; ``inputs`` has exactly the batch's keys (int64 targets,
    float64 values), each [N] or, for per-target keys with ``[N, K]`` targets, [N, K]; ``routing`` int64
    [N, L, k] expert ids to replay (−1 rows: the router chooses) or None; ``images`` its images in token order
    (checked against ``tokens`` and the model's tower)."""

    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]
    routing: torch.Tensor | None = None
    images: tuple[ImageInput, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Batch:
    """A request ready to run: its datums, loss, keys and packing plan (identical on every rank).

    Attributes:
        datums: the validated datums, in request order.
        loss: the resolved loss choice.
        input_keys: the keys every datum carries (``target_tokens`` first).
        target_k: None for ``[N]`` targets, else K of ``[N, K]`` targets.
        plan: rows of datums per DP rank under the per-rank budget.
        adapter_of_datum: several LoRA runs in one pass (:mod:`ringtune.engine.lora_batch`): the index of the
            run each datum belongs to, in request order; None: one run.
    """

    datums: tuple[BatchDatum, ...]
    loss: LossConfig
    input_keys: tuple[str, ...]
    target_k: int | None
    plan: PackingPlan
    adapter_of_datum: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(d.num_tokens for d in self.datums)


# --------------------------------------------------------------------------------------------------- conversion


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _from_list(value: Sequence, field: str, integer: bool) -> torch.Tensor:
    """A (nested) list of numbers -> tensor; bools, strings and ragged lists are refused."""
    flat: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(item)
        else:
            flat.append(item)
    for item in flat:
        if isinstance(item, bool) or not isinstance(item, Real):
            raise UserInputError(f"{field}: holds {_describe(item)} ({type(item).__name__}); expected numbers")
        if integer and not isinstance(item, Integral):
            raise UserInputError(f"{field}: holds {_describe(item)}; expected integer token ids")
    try:
        return torch.tensor(value, dtype=torch.int64 if integer else torch.float64, device="cpu")  # request values
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise UserInputError(f"{field}: not a rectangular array of numbers ({exc})") from None


def as_tensor(value: Any, field: str, *, integer: bool) -> torch.Tensor:
    """``value`` (tensor, NumPy array or list) as a CPU tensor: int64 if ``integer``, else float64.

    Raises UserInputError naming ``field`` for bools, strings, complex or float values where integers are
    expected, and any other type.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iuf":
            raise UserInputError(f"{field}: NumPy dtype {value.dtype} is not numeric (int or float)")
        value = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, list | tuple):
        return _from_list(value, field, integer)
    if not isinstance(value, torch.Tensor):
        raise UserInputError(f"{field}: expected a tensor, array or list of numbers; got {type(value).__name__}")
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise UserInputError(f"{field}: dtype {value.dtype} is not a number type")
    if integer and value.dtype.is_floating_point:
        raise UserInputError(f"{field}: dtype {value.dtype}; token ids must be integers (int64)")
    return value.detach().to("cpu", torch.int64 if integer else torch.float64).contiguous()


# --------------------------------------------------------------------------------------------------- checks


def _check_ids(ids: torch.Tensor, field: str, vocab_size: int) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        index = ", ".join(map(str, where))
        raise UserInputError(f"{field}[{index}]={int(ids[where])} is outside the vocabulary [0, {vocab_size})")


def _datum(
    raw: Any, i: int, loss: LossConfig, *, vocab_size: int, max_target_k: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Validate and convert datum ``i`` (every key it sent); raises UserInputError."""
    if not hasattr(raw, "tokens") or not hasattr(raw, "inputs"):
        raise UserInputError(f"data[{i}]: expected a TrainDatum (tokens, inputs); got {type(raw).__name__}")
    tokens = as_tensor(raw.tokens, f"data[{i}].model_input", integer=True)
    if tokens.dim() != 1:
        raise UserInputError(f"data[{i}].model_input: shape {list(tokens.shape)}; expected [N] token ids")
    if tokens.numel() == 0:
        raise UserInputError(f"data[{i}].model_input: 0 tokens; a datum needs at least 1")
    _check_ids(tokens, f"data[{i}].model_input", vocab_size)
    if not isinstance(raw.inputs, Mapping):
        raise UserInputError(f"data[{i}].loss_fn_inputs: expected a mapping; got {type(raw.inputs).__name__}")
    inputs: dict[str, torch.Tensor] = {}
    for key, value in raw.inputs.items():
        if not isinstance(key, str):
            raise UserInputError(f"data[{i}].loss_fn_inputs: key {_describe(key)} is not a string")
        field = f"data[{i}].loss_fn_inputs[{key!r}]"
        inputs[key] = as_tensor(value, field, integer=key == "target_tokens")
    check_datum_inputs(loss.loss_fn, i, tokens.numel(), inputs)
    targets = inputs["target_tokens"]
    if targets.dim() == 2 and targets.shape[1] > max_target_k:
        raise UserInputError(
            f"data[{i}].loss_fn_inputs['target_tokens']: K={targets.shape[1]} targets per position, over the "
            f"limit max_target_k={max_target_k}"
        )
    _check_ids(targets, f"data[{i}].loss_fn_inputs['target_tokens']", vocab_size)
    return tokens, inputs


def check_routing(raw: Any, i: int, n: int, moe_shape: tuple[int, int, int] | None) -> torch.Tensor | None:
    """Datum ``i``'s ``routing`` as int64 [n, L, k] (None when it has none); UserInputError naming the problem.

    ``moe_shape``: (MoE layers L, experts per token k, experts E) of the model, None for a dense model."""
    value = getattr(raw, "routing", None)
    if value is None:
        return None
    field = f"data[{i}].routing"
    if moe_shape is None:
        raise UserInputError(f"{field}: routing replay needs a mixture-of-experts model; this one has no MoE layer")
    layers, k, experts = moe_shape
    routing = as_tensor(value, field, integer=True)
    if tuple(routing.shape) != (n, layers, k):
        raise UserInputError(
            f"{field}: shape {list(routing.shape)}; expected [{n}, {layers}, {k}] (tokens, MoE layers, k)"
        )
    partial = (routing < 0).any(-1) & (routing >= 0).any(-1)
    if bool(partial.any()) or bool((routing < -1).any()) or bool((routing >= experts).any()):
        raise UserInputError(f"{field}: each [token, layer] row holds k expert ids in [0, {experts}) or k times -1")
    return routing


def _complete(inputs: dict[str, torch.Tensor], keys: tuple[str, ...], loss: LossConfig, i: int, n: int):
    """The datum's values for exactly ``keys``: sent ones as they are, optional ones filled with defaults."""
    out = {}
    for key in keys:
        if key in inputs:
            out[key] = inputs[key]
        else:
            out[key] = torch.full((n,), input_default(loss, key), dtype=torch.float64, device="cpu")
    if all(k in out for k in CLIP_KEYS):
        above = out["clip_low_threshold"] > out["clip_high_threshold"]
        if bool(above.any()):
            t = int(above.nonzero()[0, 0])
            raise UserInputError(
                f"data[{i}]: clip_low_threshold[{t}]={float(out['clip_low_threshold'][t])} > "
                f"clip_high_threshold[{t}]={float(out['clip_high_threshold'][t])} (a missing one takes the "
                f"loss_fn_config value); needs low <= high"
            )
    return out


def build_batch(
    data: Sequence[Any],
    loss_fn: str,
    loss_config: Mapping[str, Any] | None,
    *,
    vocab_size: int,
    dp_size: int,
    cp_size: int,
    max_tokens_per_rank: int,
    pad_multiplier: int = 8,
    max_target_k: int = MAX_TARGET_K,
    moe_shape: tuple[int, int, int] | None = None,
    vision: VisionConfig | None = None,
) -> Batch:
    """Validate a request and plan it (see the module docstring); raises UserInputError, changes nothing.

    ``vision``: the model's vision tower (None: text only, datums with images are refused).

    Pure: the same request gives the same Batch on every rank.
    """
    if isinstance(data, str | bytes) or not isinstance(data, Sequence):
        raise UserInputError(f"data: expected a list of datums; got {type(data).__name__}")
    if not data:
        raise UserInputError("data: the request holds no datums")
    if len(data) > MAX_DATUMS:
        raise UserInputError(f"data: {len(data)} datums, over the limit of {MAX_DATUMS} per request")
    if loss_config is not None and not isinstance(loss_config, Mapping):
        raise UserInputError(f"loss_fn_config: expected a mapping of names to numbers; got {_describe(loss_config)}")
    loss = parse_loss_config(loss_fn, loss_config)
    sent = [_datum(raw, i, loss, vocab_size=vocab_size, max_target_k=max_target_k) for i, raw in enumerate(data)]
    trailing = sent[0][1]["target_tokens"].shape[1:]
    for i, (_, inputs) in enumerate(sent):
        if inputs["target_tokens"].shape[1:] != trailing:
            raise UserInputError(
                f"data[{i}].loss_fn_inputs['target_tokens']: shape {list(inputs['target_tokens'].shape)}, but "
                f"data[0]'s is [N{', ' + str(trailing[0]) if trailing else ''}]; one request holds [N] targets or "
                f"[N, K] targets with one K"
            )
    # Per-token thresholds are carried (both, filled from the config where a datum omits one) only when some
    # datum sends one; otherwise the loss reads the config's scalar thresholds.
    per_token_clip = any(k in inputs for _, inputs in sent for k in CLIP_KEYS)
    keys = tuple(k for k in used_inputs(loss.loss_fn) if k not in CLIP_KEYS or per_token_clip)
    datums = tuple(
        BatchDatum(
            tokens=tokens,
            inputs=_complete(inputs, keys, loss, i, tokens.numel()),
            routing=check_routing(data[i], i, tokens.numel(), moe_shape),
            images=check_images(getattr(data[i], "images", ()) or (), tokens, f"data[{i}]", vision),
        )
        for i, (tokens, inputs) in enumerate(sent)
    )
    plan = pack_datums(
        [d.num_tokens for d in datums],
        dp_size=dp_size,
        cp_size=cp_size,
        max_tokens_per_rank=max_tokens_per_rank,
        pad_multiplier=pad_multiplier,
    )
    return Batch(
        datums=datums,
        loss=loss,
        input_keys=keys,
        target_k=int(trailing[0]) if trailing else None,
        plan=plan,
    )
