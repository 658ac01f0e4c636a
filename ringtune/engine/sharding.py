"""Sharded parameters, gradients and AdamW state (FSDP2) with the same numbers as the replicated engine.

The sharding is picked by name from :data:`SHARDINGS` (the one place; ``Trainer(shard_params=...)`` and
``ringtune serve --shard-params``):

- ``none``: replicated parameters (the engine SUMs the gradients at ``optim_step``, :mod:`gradients`);
- ``dp`` (HSDP): a 2-D DeviceMesh ``("cp", "dp")``; parameters are DTensors ``(Replicate(), Shard(0))``, split
  along dim 0 over the DP group and identical on the ranks of a CP group. Backward reduce-scatters a unit's
  gradients over DP and all-reduces them over CP. Per rank: 1/DP of the parameters, gradients and moments;
- ``dp_cp`` (torchtitan's ``dp_shard_cp``): a 1-D DeviceMesh ``("dp_cp",)`` on the mesh's ``dp_cp_group``;
  parameters are ``(Shard(0),)`` over all DP·CP ranks (the CP ranks of a row hold identical replicas and the
  gradient is a SUM over DP×CP anyway, so nothing ties a shard to a DP coordinate). Backward reduce-scatters
  over DP×CP in one collective. Per rank: 1/(DP·CP) of the parameters, gradients and moments.

Under expert parallelism only ``dp_cp`` applies: the experts are first sharded over their expert replica group
(:mod:`ringtune.engine.expert_sharding`), then the rest as above.

``shard_params(model, mesh, sharding=...)`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer
and then to the root (embeddings, final norm, ``lm_head``) over that DeviceMesh, built with
``DeviceMesh.from_group`` on the mesh's existing groups (no new process group); AdamW built on the DTensor
parameters keeps sharded state. Forward all-gathers a unit's parameters; backward reduces its gradients into
the sharded ``.grad`` on every backward, so accumulation over microbatches and ``forward_backward`` calls stays
a sum.

The gradient rule (context-parallel.md §3) is a plain SUM over DP×CP. FSDP2 divides by the DP×CP size by
default; every unit is set to ``set_gradient_divide_factor(1.0)`` with ``set_force_sum_reduction_for_comms(True)``
(reductions are ``ReduceOp.SUM`` only: gloo has no PREMUL_SUM/AVG, and nothing is divided). The rule is
checked, not trusted: :func:`shard_params` runs one probe backward of a fixed row on the replicated model
before sharding and again through FSDP after, and every unit's reduced gradient must be DP·CP times the
local one, in both shardings (:class:`GradientInvariantError` names the unit otherwise). Param gradients never
pass through :func:`ringtune.engine.gradients.reduce_gradients`; the canary still does, so the per-step
invariant keeps checking the loss path (no microbatch scaling) and the microbatch count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from ringtune.engine import expert_sharding
from ringtune.engine.gradients import GradientInvariantError
from ringtune.errors import UserInputError
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.moe import is_expert_parameter
from ringtune.models.logprob_head import IGNORE_INDEX, label_logprobs
from ringtune.models.shard import shard_of
from ringtune.parallel.collectives import all_reduce_
from ringtune.parallel.mesh import ParallelMesh

PROBE_TOKENS = 16
"""Length of the start-up probe row (run whole on every rank, no CP)."""

SHARDINGS = ("none", "dp", "dp_cp")
"""Parameter shardings by name: replicated, FSDP2 over DP (replicated over CP), FSDP2 over DP x CP."""

LEGACY_SHARDINGS = {False: "none", True: "dp"}
"""``Trainer(shard_params=False/True)`` as before the registry: True is the DP (HSDP) sharding."""


def check_sharding(value: object, field: str = "shard_params") -> str:
    """The sharding name of ``value`` (a name of :data:`SHARDINGS`, or a bool as :data:`LEGACY_SHARDINGS`);
    UserInputError naming ``field``, the value and the choices otherwise."""
    if isinstance(value, bool):
        return LEGACY_SHARDINGS[value]
    if not isinstance(value, str) or value not in SHARDINGS:
        raise UserInputError(f"{field}={value!r}: choose one of {', '.join(SHARDINGS)}")
    return value


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a sharding splits each parameter over: ``group`` (a data group of the mesh), its ``size`` and
    this rank's ``index`` in it (its shard is the dim-0 chunk ``index`` of ``size``)."""

    group: dist.ProcessGroup
    size: int
    index: int


def shard_group(mesh: ParallelMesh, sharding: str) -> ShardGroup:
    """The shard group of ``sharding`` on ``mesh``: the DP group (``dp``) or the DP×CP group (``dp_cp``).

    The DP×CP group's ranks are ``mesh.ranks[:, :, tp]`` in (dp, cp) order, so this rank's index is
    ``dp_rank·cp + cp_rank`` (read from the group itself).
    """
    if sharding == "dp":
        return ShardGroup(mesh.dp_group, mesh.dp_size, mesh.dp_rank)
    if sharding == "dp_cp":
        return ShardGroup(mesh.dp_cp_group, mesh.dp_size * mesh.cp_size, dist.get_rank(mesh.dp_cp_group))
    raise ValueError(f"sharding={sharding!r} shards nothing (choices with a shard group: dp, dp_cp)")


def hsdp_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The 2-D DeviceMesh ``("cp", "dp")`` of this replica (replicate over CP, shard over DP) for fully_shard.

    Built with ``DeviceMesh.from_group`` on the mesh's own CP and DP groups: no new process group, so it is
    local to the replica (meshes laid side by side do not have to call it together).
    """
    ranks = mesh.ranks[:, :, mesh.tp_rank].T.contiguous()  # [cp, dp] global ranks
    return DeviceMesh.from_group(
        [mesh.cp_group, mesh.dp_group], mesh.device_type, mesh=ranks, mesh_dim_names=("cp", "dp")
    )


def dp_cp_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The 1-D DeviceMesh ``("dp_cp",)`` of this replica (shard over all DP×CP ranks) for fully_shard.

    Built with ``DeviceMesh.from_group`` on the mesh's ``dp_cp_group`` (no new process group); its ranks in
    (dp, cp) order, the group's own order.
    """
    ranks = mesh.ranks[:, :, mesh.tp_rank].flatten().contiguous()
    return DeviceMesh.from_group(mesh.dp_cp_group, mesh.device_type, mesh=ranks, mesh_dim_names=("dp_cp",))


DEVICE_MESHES = {"dp": hsdp_mesh, "dp_cp": dp_cp_mesh}
"""The DeviceMesh each sharding hands to ``fully_shard``."""


def layer_policy(compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """The decoder layers' FSDP2 policy: none (the parameters' dtype) or, mixed, ``param_dtype=compute_dtype``
    (the all-gathered unsharded parameters and the layer's inputs are cast to it) with ``reduce_dtype=float32``
    (each backward's gradient is cast to float32 before it is reduced and added into the float32 shard)."""
    if compute_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard_params(
    model: CausalLM,
    mesh: ParallelMesh,
    *,
    attention: str,
    gated_delta: str,
    fault: str | None = None,
    compute_dtype: torch.dtype | None = None,
    sharding: str = "dp",
) -> list[FSDPModule]:
    """In place: FSDP2 on each decoder layer and on the root, SUM reductions, checked; returns the units.

    ``sharding``: ``dp`` or ``dp_cp`` (:data:`SHARDINGS`). Collective over the replica's DP×CP group (every rank
    calls it with an identical model). The root keeps
    its parameters unsharded after forward (``reshard_after_forward=False``): the trainer reads
    ``model.output_weight`` after ``hidden_states`` returns (the chunked head is outside the forward), and
    the root's gradients are reduced by FSDP's end-of-backward callback. ``hidden_states`` is registered as
    an FSDP forward method. ``fault="fsdp_default_divide"`` leaves the layers at FSDP's default (a mean),
    for negative controls only. Raises GradientInvariantError if a unit's reduced gradient is not the SUM.
    ``attention``/``gated_delta`` are the trainer's modes (the probe runs at CP 1, where every mode works).
    ``compute_dtype`` (mixed precision, :mod:`ringtune.models.precision`): the layers get :func:`layer_policy`,
    the root (embeddings, final norm, head) keeps float32; the caller has set the layers' ``compute_dtype`` so
    the probe before sharding computes as FSDP will.
    """
    if sharding not in DEVICE_MESHES:
        raise ValueError(f"sharding={sharding!r}: shard_params takes one of {', '.join(DEVICE_MESHES)}")
    expert_sharding.check(model, mesh, sharding)
    shards = shard_group(mesh, sharding)
    experts = _expert_shards(mesh)  # EP: the expert tensors are chunked over their replica group
    probe = _probe_gradients(model, attention, gated_delta)
    local = {}
    for name, g in probe.items():
        split = experts if experts is not None and is_expert_parameter(name) else shards
        local[name] = _dim0_chunk(g, split.size, split.index)
    del probe
    device_mesh = DEVICE_MESHES[sharding](mesh)
    policy = layer_policy(compute_dtype)
    units: list[FSDPModule] = expert_sharding.shard_experts(model, mesh, policy)  # first: the layers skip them
    # a unit's reduced gradient over the probe's local one: DP·CP (a SUM); EP experts already summed the EP
    # group's copies of the probe row in the all-to-all backward, so their replica group adds (DP·CP)/EP
    expected = [float(experts.size) for _ in units] if experts is not None else []
    for layer in model.model.layers:
        units.append(fully_shard(layer, mesh=device_mesh, reshard_after_forward=True, mp_policy=policy))
    root = fully_shard(model, mesh=device_mesh, reshard_after_forward=False)
    units.append(root)
    register_fsdp_forward_method(model, "hidden_states")
    for unit in units:
        if fault == "fsdp_default_divide" and unit is not root:
            continue
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    reduced = _probe_gradients(model, attention, gated_delta)
    expected += [float(mesh.dp_size * mesh.cp_size)] * (len(units) - len(expected))
    _check_sum(model, units, local, reduced, expected, shards)
    return units


def _expert_shards(mesh: ParallelMesh) -> ShardGroup | None:
    """The expert replica group the EP experts are sharded over (:mod:`expert_sharding`); None without EP."""
    if mesh.ep_size == 1:
        return None
    group = mesh.expert_replica_group
    return ShardGroup(group, expert_sharding.replicas(mesh), dist.get_rank(group))


def reshard_all(units: list[FSDPModule]) -> None:
    """Register the sharded parameters everywhere (the root stays unsharded after a forward without backward;
    call before the optimizer changes the shards, so the next forward all-gathers the new values)."""
    for unit in units:
        unit.reshard()


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 units inside ``model`` (empty for a replicated model)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def full_state_dict(
    model: nn.Module,
    *,
    keep: bool = True,
    device: torch.device | str = "cpu",
    keep_also: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """``model.state_dict()`` with every DTensor gathered whole onto ``device``; a replicated model's as it is.

    Sharded: first reshards every unit (the root stays unsharded after a forward, and its registered tensors
    would then be the unsharded ones), then gathers tensor by tensor (``full_tensor``: collective over the
    tensor's mesh, so every rank of the sharded model calls this together, in the same order). ``keep=False``:
    this rank takes part in the gathers but keeps nothing (returns {}); a writer on one rank then holds the
    full state once and the others one tensor at a time. ``keep_also(name)``: entries kept even then (e.g. the
    EP experts, gathered next over the EP group). Plain tensors are returned as they are (not copied).
    """
    units = fsdp_modules(model)
    if not units:
        return model.state_dict()
    reshard_all(units)
    out: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor().to(device)
        if keep or (keep_also is not None and keep_also(name)):
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------------- the check


def _probe_gradients(model: CausalLM, attention: str, gated_delta: str) -> dict[str, torch.Tensor]:
    """Backward of a fixed whole row (same on every rank, CP 1): {name: grad}, then ``.grad`` is cleared.

    On the sharded model the grads are FSDP's reduced local shards (through the trainer's access pattern:
    ``hidden_states``, then ``output_weight``, then the chunked head).
    """
    vocab = model.config.vocab_size
    device = model.model.embed_tokens.weight.device
    ids = (torch.arange(PROBE_TOKENS, dtype=torch.int64, device=device) * 7 + 3) % vocab
    labels = torch.roll(ids, -1)
    labels[-1] = IGNORE_INDEX
    shard = shard_of((PROBE_TOKENS,), attention=attention, gated_delta=gated_delta, pad_multiplier=8)
    hidden = model.hidden_states(ids, shard)
    label_logprobs(hidden, model.output_weight, labels).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad
            grads[name] = (
                torch.zeros(0, device=device) if g is None else (g.to_local() if isinstance(g, DTensor) else g).detach()
            )
            p.grad = None
    return grads


def _dim0_chunk(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """FSDP2's dim-0 shard ``index`` of ``parts`` (torch.chunk; ranks past the last chunk hold an empty one)."""
    chunks = torch.chunk(t, parts, dim=0)
    return chunks[index].clone() if index < len(chunks) else t[:0].clone()


def _check_sum(
    model: CausalLM,
    units: list[FSDPModule],
    local: dict,
    reduced: dict,
    expected: list[float],
    shards: ShardGroup,
) -> None:
    """Per unit, over its shards: reduced = ``expected[unit]`` × local (ratio <reduced, local> / <local, local>,
    and the relative residual |reduced − W·local| / |W·local|); a mean gives ratio 1, a wrong shard a residual.
    Units in order: EP expert units, the layers, the root."""
    # float64: sums of DP·CP equal terms are exact or one rounding off; lower precisions round at every add.
    rtol = 1e-9 if next(model.parameters()).dtype == torch.float64 else 1e-2
    layers = len(model.model.layers)
    experts = len(units) - layers - 1
    labels = [f"experts of MoE layer {i}" for i in range(experts)] + [f"model.layers.{i}" for i in range(layers)]
    labels.append("root")
    owner: dict[int, int] = {}
    for i, unit in enumerate(units):  # experts, then layers: the root's (and a layer's) parameters() include theirs
        for p in unit.parameters():
            owner.setdefault(id(p), i)
    device = model.model.embed_tokens.weight.device  # the data groups' device (NCCL on CUDA)
    sums = torch.zeros(
        len(units), 4, dtype=torch.float64, device=device
    )  # <got, want>, <want, want>, |got - W·want|², |W·want|²
    for name, p in model.named_parameters():
        if name not in local:
            continue
        want, got = local[name], reduced[name]
        if got.numel() != want.numel():
            raise GradientInvariantError(
                f"FSDP probe: {name}'s local gradient shard has {got.numel()} elements, expected {want.numel()} "
                f"(the dim-0 chunk {shards.index} of {shards.size}); the sharding layout is not the one checked"
            )
        want, got = want.double().reshape(-1), got.double().reshape(-1)
        scaled = expected[owner[id(p)]] * want
        terms = [(got * want).sum(), (want * want).sum(), (got - scaled).pow(2).sum(), scaled.pow(2).sum()]
        sums[owner[id(p)]] += torch.stack(terms)
    all_reduce_(sums, shards.group)
    for label, want, (cross, norm2, residual2, scale2) in zip(labels, expected, sums.tolist(), strict=True):
        if norm2 == 0:
            raise GradientInvariantError(f"FSDP probe: unit {label} got no gradient from the probe row")
        ratio, residual = cross / norm2, math.sqrt(residual2 / scale2)
        if not math.isclose(ratio, want, rel_tol=rtol) or residual > rtol:
            raise GradientInvariantError(
                f"gradient invariant violated: FSDP unit {label} reduced its gradients to {ratio:.6g} x the local "
                f"one (relative residual {residual:.3g}), expected {want:g} x (the ranks it sums over, a SUM); "
                "FSDP averages by default: every unit needs set_gradient_divide_factor(1.0)"
            )
