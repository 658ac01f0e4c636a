"""AdamW with the hyper-parameters of each optim_step call, global grad-norm clipping, and the exact trial update
of the finite guard (:mod:`ringtune.engine.update_guard` decides when it runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as functional_adam
from torch.optim.optimizer import _get_scalar_dtype

from ringtune.engine.blocked_adamw import blocked_step, blocked_supported
from ringtune.errors import UserInputError


@dataclass(frozen=True, kw_only=True)
class AdamParams:
    """Tinker's ``AdamParams`` (same names and defaults as the SDK)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        """UserInputError naming the field, value and limit; checked before anything changes.

        Every field must be a real number (bools and strings are refused), finite and within its range.
        """
        limits = {
            "learning_rate": (lambda v: v >= 0, ">= 0"),
            "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "eps": (lambda v: v > 0, "> 0"),
            "weight_decay": (lambda v: v >= 0, ">= 0"),
            "grad_clip_norm": (lambda v: v >= 0, ">= 0 (0 = off)"),
        }
        for name, (ok, limit) in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise UserInputError(
                    f"adam_params.{name}={value!r} ({type(value).__name__}) must be a real number {limit}"
                )
            if not (math.isfinite(float(value)) and ok(float(value))):
                raise UserInputError(f"adam_params.{name}={value!r} must be finite and {limit}")


def prepare_step(optimizer: torch.optim.AdamW, adam: AdamParams, *, norm: float) -> float:
    """Set ``adam``'s hyper-parameters on every param group and return the factor that clips the gradients to
    ``adam.grad_clip_norm`` (0 = off) given their global ``norm`` (1.0: not clipped); changes no tensor: the
    trial (:func:`non_finite_update`) and the update (:func:`apply_step`) apply the factor."""
    scale = 1.0
    if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
        scale = adam.grad_clip_norm / (norm + 1e-6)
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay
    return scale


ADAMW_KERNELS = ("fused", "torch_default")
"""How AdamW's update runs: ``fused`` (torch's one-kernel AdamW, ``fused=True``: one pass reading each weight,
gradient and moment once, no parameter-sized temporaries, fewer launches), ``torch_default`` (what
``torch.optim.AdamW`` picks: foreach on CUDA, a loop of about eight elementwise passes per tensor on CPU,
:mod:`ringtune.engine.blocked_adamw` runs those in cache-sized blocks). The update is the same AdamW either way
(equal to float32 rounding, tests/test_engine_requests.py)."""

FUSED_DEVICE_TYPES = ("cpu", "cuda")
"""Devices where the trainer's default is ``fused``: torch has the kernel on both. On the CPU it took 0.07 s where
the per-tensor loop took 0.45 s for SmolLM2-135M's state (float32, one thread; benchmarks/lean_step.py)."""


def default_adamw_kernel_for(device_type: str) -> str:
    """The AdamW kernel a trainer on ``device_type`` runs unless told: ``fused`` on :data:`FUSED_DEVICE_TYPES`,
    else ``torch_default``. The serve banner (:mod:`ringtune.worker.device_defaults`) reads the same rule."""
    return "fused" if device_type in FUSED_DEVICE_TYPES else "torch_default"


def default_adamw_kernel(params: list[torch.nn.Parameter]) -> str:
    """:func:`default_adamw_kernel_for` the parameters' one device type when every parameter is floating point
    (the fused kernel's domain), else ``torch_default``."""
    types = {p.device.type for p in params}
    if len(types) != 1 or not all(p.is_floating_point() for p in params):
        return "torch_default"
    return default_adamw_kernel_for(types.pop())


def new_adamw(params: list[torch.nn.Parameter], kernel: str | None = None) -> torch.optim.AdamW:
    """The trainer's AdamW over ``params`` (lr 0 until :func:`prepare_step` sets each call's hyper-parameters),
    run by ``kernel`` of :data:`ADAMW_KERNELS` (None: :func:`default_adamw_kernel`). ValueError for another name."""
    kernel = default_adamw_kernel(params) if kernel is None else kernel
    if kernel not in ADAMW_KERNELS:
        raise ValueError(f"adamw kernel {kernel!r}: choose one of {', '.join(ADAMW_KERNELS)}")
    return torch.optim.AdamW(params, lr=0.0, fused=True if kernel == "fused" else None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP-sharded parameter, gradient or moment); ``t`` otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def non_finite_update(
    optimizer: torch.optim.AdamW,
    params: list[torch.nn.Parameter],
    *,
    only: set[int] | None = None,
    grad_scale: float = 1.0,
) -> list[int]:
    """Indices into ``params`` whose next AdamW update, on the gradients times ``grad_scale`` (the clipping
    :func:`apply_step` will apply), would put a non-finite value in the weight or in either moment; changes
    nothing (run after :func:`prepare_step`, before :func:`apply_step`). ``only``: try just these indices (the
    ones :func:`ringtune.engine.update_guard.unsafe_updates` could not bound); None: every one.

    A finite gradient can still overflow the update: in float32 an element of 2.9e32 squares to inf in the
    second moment, after which that weight never moves again. Each parameter's update is run here on
    copies of this rank's (local) weight, moments and step count by torch's own functional AdamW with the
    param group's settings (``foreach`` / ``fused`` as the optimizer picks them), so the verdict is the one
    :func:`apply_step` would reach; a step torch itself refuses (a step size that overflows the dtype, which
    would raise in :func:`apply_step` after earlier parameters moved) counts as non-finite.
    Extra memory: three copies of the largest parameter (one at a time). The verdicts are read back together,
    one device sync for all parameters.
    """
    tried: list[int] = []  # indices into params, in the order their trials ran
    finite: list[torch.Tensor] = []  # per trial, on the parameter's device: the update stays finite
    index = {id(p): i for i, p in enumerate(params)}
    in_kernel = grad_scale != 1.0 and _kernel_clip(optimizer)  # as apply_step clips
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or id(p) not in index or (only is not None and index[id(p)] not in only):
                continue
            weight, grad = _local(p.detach()).clone(), _local(p.grad)
            divisor = None  # the fused kernel's own unscaling, as apply_step runs it (_kernel_clip)
            if in_kernel:
                grad, divisor = grad.clone(), _kernel_divisor(grad_scale, grad.device)  # the kernel writes grad
            elif grad_scale != 1.0:
                grad = grad * grad_scale  # the bits apply_step's in-place clipping gives
            state = optimizer.state.get(p, {})
            m = _local(state["exp_avg"]).clone() if "exp_avg" in state else torch.zeros_like(weight)
            v = _local(state["exp_avg_sq"]).clone() if "exp_avg_sq" in state else torch.zeros_like(weight)
            on_device = group["capturable"] or group["fused"]
            fresh = torch.zeros((), dtype=_get_scalar_dtype(), device=p.device if on_device else "cpu")
            step = state["step"].clone() if "step" in state else fresh
            beta1, beta2 = group["betas"]
            try:
                functional_adam(
                    [weight], [grad], [m], [v], [], [step],
                    foreach=group["foreach"], capturable=group["capturable"], fused=group["fused"], grad_scale=divisor,
                    decoupled_weight_decay=group.get("decoupled_weight_decay", True), amsgrad=False,
                    beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False,
                )  # fmt: skip
            except RuntimeError:  # torch refuses a step size that overflows the weight's dtype (lr=1e39 in float32)
                ok = torch.zeros((), dtype=torch.bool, device=weight.device)
            else:
                ok = torch.isfinite(weight).all() & torch.isfinite(m).all() & torch.isfinite(v).all()
            tried.append(index[id(p)])
            finite.append(ok)
    verdicts = torch.stack(finite).tolist() if finite else []
    return [i for i, ok in zip(tried, verdicts, strict=True) if not ok]


def apply_step(
    optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], *, grad_scale: float, checksum: bool = False
) -> dict[int, int]:
    """Clip (the gradients times ``grad_scale``, from :func:`prepare_step`) and run AdamW with the hyper-parameters
    :func:`prepare_step` set; the gradients are then dropped. Returns, with ``checksum``, the replica checksums of
    the new weights and moments by tensor ``id`` where the step took them on its way
    (:func:`~ringtune.engine.blocked_adamw.blocked_step`, the CPU's single-tensor AdamW in cache-sized blocks,
    bit-identical to the plain path below), else ``{}`` (the replica check takes them). With torch's fused kernel
    the clipping runs inside it (:func:`_kernel_clip`)."""
    sums: dict[int, int] = {}
    if blocked_supported(optimizer, params):
        sums = blocked_step(optimizer, params, grad_scale=grad_scale, checksum=checksum)
    elif grad_scale != 1.0 and _kernel_clip(optimizer):
        optimizer.grad_scale = _kernel_divisor(grad_scale, params[0].device)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
    else:
        if grad_scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums


def _kernel_clip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group runs torch's fused AdamW, whose kernel divides each gradient by the optimizer's
    ``grad_scale`` tensor as it reads it (the hook AMP's GradScaler uses): clipping then costs no pass over the
    gradients of its own (a read and a write of each, ~2/7 of the fused update's traffic). Not for FSDP's DTensor
    parameters (the divisor is a plain tensor, which DTensor's dispatch of the kernel would have to accept), nor for
    float64 ones: the kernel takes a float32 divisor, whose rounding (~1e-8 relative) would set a replicated float64
    run apart from a sharded one (which clips by the separate pass) far above the 1e-10 the layouts agree to."""
    groups = optimizer.param_groups
    return bool(groups) and all(
        g.get("fused") and not any(isinstance(p, DTensor) or p.dtype == torch.float64 for p in g["params"])
        for g in groups
    )


def _kernel_divisor(grad_scale: float, device: torch.device) -> torch.Tensor:
    """The fused kernel's divisor for the clip factor ``grad_scale``: ``1 / grad_scale`` as a float32 0-d tensor on
    ``device`` (the kernel's ``g / divisor`` and ``g * grad_scale`` differ by rounding only; the exact trial,
    :func:`non_finite_update`, runs the same kernel with the same divisor)."""
    return torch.tensor(1.0 / grad_scale, dtype=torch.float32, device=device)
