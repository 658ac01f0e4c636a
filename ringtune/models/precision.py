"""Numeric precision of a served model: one knob, chosen here and read by every caller.

``ringtune serve --dtype NAME`` (``ModelSpec.dtype``, ``LocalBackend(dtype=...)``, ``BackendInfo.dtype``) names
one entry of :data:`PRECISIONS`:

| name | parameters, gradients, AdamW moments, DCP checkpoints | decoder-layer compute | HF export |
|---|---|---|---|
| ``float32`` / ``bfloat16`` / ``float64`` | that dtype | that dtype | that dtype |
| ``bf16-mixed`` | float32 (master weights) | bfloat16 | the checkpoint's original dtype |
| ``bf16-exact`` | float32 (master weights) | bfloat16 values, float64 arithmetic | the checkpoint's original dtype |

In ``bf16-mixed`` the decoder layers (norms, mixers, MLPs) run their forward and backward in bfloat16 on a
bfloat16 copy of their weights, cast from the float32 masters at each use, and gradients come back to the
masters in float32: a layer's gradient is formed in bfloat16 within one backward (as FSDP2 forms it on its
bfloat16 unsharded parameters) and summed over microbatches, calls and DP×CP ranks in float32. What the
reference implementations (transformers) keep in float32 stays float32 inside the layers: RMSNorm and the
GatedDeltaNet output norm normalise in float32, the gates ``g`` are float32, the chunked delta-rule scan and
its recurrent state run in float32 (see ``ringtune.ops.gated_delta``), attention accumulates its softmax in
float32. The embeddings, the final norm and the log-prob head stay in float32 end to end (the head's tiles
compute logits and log-sum-exps in float32 from the float32 weight), and so do the losses.

``bf16-exact`` (exact arithmetic) keeps the bf16 values and computes between them in float64: a layer reads
its weights rounded to bfloat16 (held as float64), rounds its input, every linear projection's input and output,
every norm's output and the residual stream to bfloat16, and computes everything else (matmul sums, attention
and its CP merge, the GatedDeltaNet scan and its CP state hand-off, softmax, SiLU, rotary) in float64; its output
leaves in bfloat16, as under ``bf16-mixed``. Each rounded value is then the correctly rounded bfloat16 of a
float64 result whose error (~1e-16 relative) is far below half a bfloat16 ulp (2^-9), so it does not depend on
the batch size, the packing, the CP layout or the kernel: the sampler's one-token decode and the trainer's packed
forward give the same bits (KL(sampler ‖ trainer) ~0 in bf16, docs/parity.md), at the price of float64 matmuls
(about 4x bf16's time on a CPU with bf16 units; far more on a GPU, where batch-invariant bf16 kernels would be
the way, not built). See :func:`layer_params` and :func:`install_exact_rounding`.

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
from ringtune.models.layers.norms import RMSNorm


@dataclass(frozen=True)
class Precision:
    """One precision: ``param_dtype`` for parameters, gradients, moments and checkpoints; ``compute_dtype`` for
    the decoder layers' forward and backward (equal unless mixed)."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    exact: bool = False
    """The layers' arithmetic is float64 on ``compute_dtype`` values (module docstring); only when mixed."""

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
        Precision("bf16-exact", torch.float32, torch.bfloat16, exact=True),
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


ARITHMETIC_DTYPE = torch.float64
"""The arithmetic of exact layers (``Precision.exact``)."""


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None, *, exact: bool = False) -> None:
    """Make every decoder layer of ``model`` (a ``CausalLM``) compute in ``dtype`` (None: its parameters' dtype);
    ``exact``: on ``dtype`` values in float64 arithmetic (needs ``dtype``; installs :func:`install_exact_rounding`
    on each layer, removing what an earlier call installed)."""
    if exact and dtype is None:
        raise ValueError("exact arithmetic needs a compute dtype (the dtype its values are rounded to)")
    for layer in model.model.layers:
        layer.compute_dtype = dtype
        layer.exact_arithmetic = exact
        for handle in getattr(layer, "_exact_rounding", ()):
            handle.remove()
        layer._exact_rounding = install_exact_rounding(layer, dtype) if exact else []


def round_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` with its values rounded to ``dtype``, kept in ``x``'s dtype (differentiable: the gradient is rounded
    the same way on its way back). Unchanged if ``x`` is not floating or already in ``dtype``."""
    if not x.is_floating_point() or x.dtype == dtype:
        return x
    return x.to(dtype).to(x.dtype)


def install_exact_rounding(layer: nn.Module, dtype: torch.dtype) -> list:
    """Round, inside ``layer``, every ``nn.Linear``'s input and output and every norm's output to ``dtype``
    (forward hooks; the residual stream is rounded by the layer itself, :func:`layer_round`). Returns the hook
    handles. These are the points where a ``dtype`` layer stores values; between them exact layers compute in
    float64."""

    def round_input(module: nn.Module, args: tuple) -> tuple:
        return (round_values(args[0], dtype), *args[1:])

    def round_output(module: nn.Module, args: tuple, out: object) -> object:
        return round_values(out, dtype) if isinstance(out, torch.Tensor) else out

    handles = []
    for sub in layer.modules():
        if isinstance(sub, nn.Linear):
            handles.append(sub.register_forward_pre_hook(round_input))
        if isinstance(sub, nn.Linear | RMSNorm):
            handles.append(sub.register_forward_hook(round_output))
    return handles


def layer_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's input as it computes on it: cast to its compute dtype (mixed), rounded to it and held in
    float64 (exact), else unchanged."""
    if layer.compute_dtype is None:
        return x
    if layer.exact_arithmetic:
        return x.to(layer.compute_dtype).to(ARITHMETIC_DTYPE)
    return x.to(layer.compute_dtype)


def layer_round(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The residual stream of a decoder layer after an add: rounded to its compute dtype when exact (a
    ``compute_dtype`` add rounds by itself), else unchanged."""
    return round_values(x, layer.compute_dtype) if layer.exact_arithmetic else x


def layer_output(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's output: in its compute dtype when exact (what a mixed layer returns), else unchanged."""
    return x.to(layer.compute_dtype) if layer.exact_arithmetic else x


def layer_params(layer: nn.Module, *, detached: bool = False):
    """The context a decoder layer computes in: its parameters read as its compute dtype (mixed), or as float64
    holding their ``compute_dtype`` rounding (exact); nothing when unmixed (:func:`compute_params`).
    ``detached``: the mixed casts are cut from autograd (the ``mixed_cast_detached_last_cp`` debug fault only)."""
    if layer.exact_arithmetic:
        return compute_params(layer, ARITHMETIC_DTYPE, via=layer.compute_dtype)
    return compute_params(layer, layer.compute_dtype, detached=detached)


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
def compute_params(
    module: nn.Module, dtype: torch.dtype | None, via: torch.dtype | None = None, *, detached: bool = False
) -> Iterator[None]:
    """Within: every floating parameter of ``module`` (and its submodules) not already in ``dtype`` reads as a
    differentiable cast of itself to ``dtype``; the parameters are put back on exit (also on an exception).
    ``via`` (exact arithmetic): the values are rounded to ``via`` first, but the gradient passes the rounding
    unrounded (straight through, in ``dtype``), so each rank's share of a parameter's gradient reaches the
    master without a ``via`` rounding and the DP×CP sum does not depend on the layout.

    The casts are ordinary autograd ops: gradients reach the original parameters in their own dtype (float32
    masters get the float32 upcast of the bfloat16 gradient). Nothing changes when ``dtype`` is None or the
    parameters are in it already (e.g. FSDP2's bfloat16 unsharded parameters). Not thread-safe for one module.
    ``detached`` (a debug fault only): the plain casts are detached, so no gradient reaches the parameters.
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
            if via is None:
                table[name] = p.to(dtype).detach() if detached else p.to(dtype)
            elif p.requires_grad:
                table[name] = _rounded_straight_through(p, via, dtype)
            else:
                table[name] = frozen_rounded(p, via, dtype)
        yield
    finally:
        for table, name, p in swapped:
            table[name] = p


def frozen_rounded(p: torch.Tensor, via: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """A frozen parameter's values rounded to ``via``, held in ``dtype``: made once per value of ``p`` and kept on
    it (keyed by its storage and version counter, so an in-place write such as a checkpoint load makes a new one).

    Why: a LoRA run's shared base is frozen, and under exact arithmetic every forward and every decode step would
    otherwise round and widen all of its layer weights again (measured: docs/memory.md "`bf16-exact`"). Cost: one
    ``dtype`` copy of each frozen layer weight (float64: twice the float32 base), shared by every run on the base.
    Not differentiable (``p`` takes no gradient); never an inference tensor."""
    key = (via, dtype, p.data_ptr(), p._version)
    cached = getattr(p, "_ringtune_rounded", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.inference_mode(False):  # made during a decode, it must still serve a training forward's autograd
        value = p.detach().to(via).to(dtype)
    p._ringtune_rounded = (key, value)
    return value


def _rounded_straight_through(p: torch.Tensor, via: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``p``'s values rounded to ``via``, held in ``dtype``; the gradient flows to ``p`` as if unrounded."""
    if not (torch.is_grad_enabled() and p.requires_grad):
        return p.to(via).to(dtype)
    wide = p.to(dtype)
    return wide + (p.detach().to(via).to(dtype) - wide.detach())


def layers_compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The compute dtype the decoder layers of ``model`` (a ``CausalLM``) were given, or None (unmixed)."""
    layers = model.model.layers
    return layers[0].compute_dtype if len(layers) else None


def layers_exact(model: nn.Module) -> bool:
    """Whether the decoder layers of ``model`` (a ``CausalLM``) compute with exact arithmetic."""
    layers = model.model.layers
    return bool(len(layers) and layers[0].exact_arithmetic)


def compute_like_trainer(model: nn.Module, dtype: torch.dtype | None, *, exact: bool = False) -> nn.Module:
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
    trainer keeps them. ``exact`` (``bf16-exact``): the trainer's exact arithmetic (float64 between ``dtype``
    roundings), so decode and the packed forward agree to the bit; the layer weights are then stored as float64
    holding their ``dtype`` rounding (4x the bytes of ``dtype``), since casting them at every decode step cost 4.7x
    the decode time (SmolLM2-135M; stored so, exact decode runs at bf16-mixed's speed). ``dtype`` None (an unmixed
    precision): nothing changes. In place, not differentiable.
    """
    if dtype is None:
        return model
    model.model.layers.to(dtype=dtype)
    if exact:
        model.model.layers.to(dtype=ARITHMETIC_DTYPE)
    set_compute_dtype(model, dtype, exact=exact)
    return model
