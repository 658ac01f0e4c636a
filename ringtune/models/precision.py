"""Numeric precision of a served model: one knob, chosen here and read by every caller.

``ringtune serve --dtype NAME`` (``ModelSpec.dtype``, ``LocalBackend(dtype=...)``, ``BackendInfo.dtype``) names
one entry of :data:`PRECISIONS`:

| name | parameters, gradients, AdamW moments, DCP checkpoints | decoder-layer compute | HF export |
|---|---|---|---|
| ``float32`` / ``bfloat16`` / ``float64`` | that dtype | that dtype | that dtype |
| ``bf16-mixed`` | float32 (master weights) | bfloat16 | the checkpoint's original dtype |

In ``bf16-mixed`` the decoder layers (norms, mixers, MLPs) run their forward and backward in bfloat16 on a
bfloat16 copy of their weights, cast from the float32 masters at each use, and gradients come back to the
masters in float32: a layer's gradient is formed in bfloat16 within one backward (as FSDP2 forms it on its
bfloat16 unsharded parameters) and summed over microbatches, calls and DP×CP ranks in float32. What the
reference implementations (transformers) keep in float32 stays float32 inside the layers: RMSNorm and the
GatedDeltaNet output norm normalise in float32, the gates ``g`` are float32, the chunked delta-rule scan and
its recurrent state run in float32 (see ``ringtune.ops.gated_delta``), attention accumulates its softmax in
float32. The embeddings, the final norm and the log-prob head stay in float32 end to end (the head's tiles
compute logits and log-sum-exps in float32 from the float32 weight), and so do the losses.

Two mechanisms give the same numbers:

- replicated parameters (:class:`~ringtune.engine.trainer.Trainer` default): :func:`set_compute_dtype` marks
  every decoder layer; the layer casts its input and, inside :func:`compute_params`, its parameters (a
  differentiable cast, so autograd returns the float32 gradient of the master);
- ``shard_params=True`` (FSDP2): ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on each
  decoder layer's ``fully_shard`` (the root keeps float32), see :mod:`ringtune.engine.sharding`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ringtune.errors import UserInputError


@dataclass(frozen=True)
class Precision:
    """One precision: ``param_dtype`` for parameters, gradients, moments and checkpoints; ``compute_dtype`` for
    the decoder layers' forward and backward (equal unless mixed)."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        """True when the layers compute in a narrower dtype than the parameters are kept in."""
        return self.compute_dtype != self.param_dtype


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("float32", torch.float32, torch.float32),
        Precision("bfloat16", torch.bfloat16, torch.bfloat16),
        Precision("float64", torch.float64, torch.float64),
        Precision("bf16-mixed", torch.float32, torch.bfloat16),
    )
}
"""Every precision by name; the first is the default."""

DEFAULT_PRECISION = "float32"

COMPUTE_DTYPES = (torch.bfloat16,)
"""Narrower compute dtypes a float32 model may run its layers in."""


def check_precision(name: object, field: str = "dtype") -> Precision:
    """The :class:`Precision` called ``name``; UserInputError naming ``field``, the value and the choices."""
    if not isinstance(name, str) or name not in PRECISIONS:
        raise UserInputError(f"{field}={name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def check_compute_dtype(model: nn.Module, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """``compute_dtype`` if the model may compute in it (None or its parameter dtype: no mixing), else ValueError.

    Mixing needs float32 parameters and a compute dtype from :data:`COMPUTE_DTYPES`.
    """
    param_dtype = next(model.parameters()).dtype
    if compute_dtype is None or compute_dtype == param_dtype:
        return None
    if param_dtype != torch.float32 or compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype={compute_dtype} on {param_dtype} parameters: mixed precision needs float32 master "
            f"weights and a compute dtype in {[str(d) for d in COMPUTE_DTYPES]}"
        )
    return compute_dtype


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Make every decoder layer of ``model`` (a ``CausalLM``) compute in ``dtype`` (None: its parameters' dtype)."""
    for layer in model.model.layers:
        layer.compute_dtype = dtype


def export_dtype(model: nn.Module, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype an HF export of ``model`` is written in: None (the parameters' dtype) unless mixed, else the
    dtype the checkpoint was loaded from (``torch_dtype`` / ``dtype`` of its HF config), else ``compute_dtype``."""
    if compute_dtype is None:
        return None
    hf = model.config.hf_config
    declared = hf.get("torch_dtype", hf.get("dtype"))
    original = getattr(torch, declared, None) if isinstance(declared, str) else None
    if isinstance(original, torch.dtype) and original.is_floating_point:
        return original
    return compute_dtype


@contextmanager
def compute_params(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Within: every floating parameter of ``module`` (and its submodules) not already in ``dtype`` reads as a
    differentiable cast of itself to ``dtype``; the parameters are put back on exit (also on an exception).

    The casts are ordinary autograd ops: gradients reach the original parameters in their own dtype (float32
    masters get the float32 upcast of the bfloat16 gradient). Nothing changes when ``dtype`` is None or the
    parameters are in it already (e.g. FSDP2's bfloat16 unsharded parameters). Not thread-safe for one module.
    """
    if dtype is None:
        yield
        return
    swapped: list[tuple[dict, str, nn.Parameter]] = []
    try:
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    swapped.append((sub._parameters, name, p))
        for table, name, p in swapped:
            table[name] = p.to(dtype)
        yield
    finally:
        for table, name, p in swapped:
            table[name] = p


def layers_compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The compute dtype the decoder layers of ``model`` (a ``CausalLM``) were given, or None (unmixed)."""
    layers = model.model.layers
    return layers[0].compute_dtype if len(layers) else None


def compute_like_trainer(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Make an inference copy ``model`` (a ``CausalLM`` without gradients) compute as a mixed trainer does; returns it.

    Why: a sampler that decodes in float32 while the trainer's layers compute in bfloat16 uses other weights (the
    unrounded masters) and another arithmetic than the policy being trained. Measured on CPU (SmolLM2-135M,
    ``benchmarks/sampler_kl_depth.py``, docs/parity.md), this alone does not shrink KL(sampler ‖ trainer): the
    mismatch there is dominated by bf16 rounding-order differences between the decode path and the packed forward,
    and is of the same size either way. It is the default because it samples with the trainer's weights and dtype
    (and half the layer memory, bf16 tensor cores on a GPU). Under ``bf16-mixed`` the sampler's decoder layers
    compute in bfloat16 like the trainer's: each layer's floating
    parameters are stored rounded to ``dtype`` (the very values :func:`compute_params` hands the trainer's forward
    at each use, kept once instead of cast per token) and the layer's ``compute_dtype`` is set, so prefill and
    decode cast their input to it. The embeddings, final norm and head stay in the parameter dtype, as the
    trainer keeps them. ``dtype`` None (an unmixed precision): nothing changes. In place, not differentiable.
    """
    if dtype is None:
        return model
    model.model.layers.to(dtype=dtype)
    set_compute_dtype(model, dtype)
    return model
