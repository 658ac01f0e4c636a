"""How the accumulated gradients become the global SUM, and their norm and finite check: one strategy object per
parameter layout, behind one interface (:class:`GradientSync`), picked by :func:`gradient_sync_for`.

- :class:`ReplicatedSync` (``shard_params="none"``, no EP): every rank holds every gradient; they are SUMmed over
  the DP×CP group in flat buckets (:func:`~ringtune.engine.gradients.reduce_gradients`) together with the
  gradient invariant's canary: during the last microbatch's backward when the request is the step's only one
  (:mod:`ringtune.engine.grad_overlap`, the same bits), else at ``optim_step``;
- :class:`ExpertParallelSync` (EP > 1, replicated): the non-expert gradients SUM over DP×CP, the expert
  gradients over the expert replica group (both canaries checked); the norm adds the EP group's expert norms;
- :class:`FsdpSync` (``dp`` / ``dp_cp``): FSDP2 reduce-scattered the gradients during backward; only the canary
  is reduced and checked; the norm is the local shards' squares SUMmed over the shard group.

Every method is collective over the groups it names, and none reads a value back to the host: the norm and the
finite verdicts are device tensors, read by the caller together with the other figures of the step (one host
sync per step, one per microbatch). Gradients are plain tensors or, under FSDP, DTensors (their local shards
are used). float64 accumulation everywhere a norm is formed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ringtune.engine import expert_parallel, sharding
from ringtune.engine.grad_overlap import OverlappedReduction
from ringtune.engine.gradients import GradientInvariant
from ringtune.engine.tensor_norms import count_non_finite, local, max_abs, squares_and_norms, sum_of_squares
from ringtune.parallel.collectives import all_reduce_
from ringtune.parallel.mesh import ParallelMesh


def _device(params: list[torch.nn.Parameter]) -> torch.device:
    return local(params[0].detach()).device if params else torch.device("cpu")


def _local_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [local(p.grad) for p in params if p.grad is not None]


def _grads_or_empty(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's local gradient, an empty tensor where it has none (so the list aligns with ``params``)."""
    device = _device(params)
    return [local(p.grad) if p.grad is not None else torch.zeros(0, device=device) for p in params]


class GradientSync:
    """The interface (and the replicated strategy's local finite check, which EP shares).

    Subclasses implement :meth:`reduce` and :meth:`norm`; :meth:`grads_finite` is local unless overridden.
    """

    name = "replicated"

    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        """SUM the accumulated ``.grad`` of ``params`` (every one set) over the layout's groups, in place, and
        check the gradient invariant (GradientInvariantError). Collective."""
        raise NotImplementedError

    def norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The L2 norm of the whole reduced gradient as a float64 0-d device tensor (inf / NaN when an element
        is). Collective where the gradient is spread over ranks; call after :meth:`reduce`."""
        raise NotImplementedError

    def norm_and_grad_bounds(self, params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`norm` and, per parameter in ``params`` order, an upper bound of max |local gradient| (float64
        ``[len(params)]``, 0 where there is none; non-finite where the gradient holds a non-finite element): what
        the step's finite guard reads (:func:`~ringtune.engine.update_guard.read_step_figures`). Here the exact
        maxima (one more read of the gradients). Collective as :meth:`norm`."""
        return self.norm(params), max_abs(_grads_or_empty(params), _device(params))

    def start_overlap(self, params: list[torch.nn.Parameter]) -> None:
        """Before the last microbatch of a request that brings the step's whole gradient: start reducing it during
        backward where this layout can (:class:`ReplicatedSync`); a no-op here."""

    def finish_overlap(self) -> None:
        """After the request's microbatches: wait for what :meth:`start_overlap` launched (collective over the
        DP×CP group where it launched anything); a no-op here."""

    def drop_overlap(self) -> None:
        """Forget a reduction made during backward (its hooks removed): the request failed or the gradients are
        about to change; local, no collective."""

    def abandon_overlap(self, *, in_step: bool) -> str | None:
        """A refused request's overlapped reduction: with ``in_step`` (the ranks agreed on the refusal and the data
        groups were not rebuilt) its buckets are still launched and waited for on every rank, so the DP×CP group
        stays in step (a rank may have launched more of them during backward than another); then dropped.
        Returns why the trainer is broken if that wait failed, else None."""
        why = None
        if in_step:
            try:
                self.finish_overlap()
            except Exception as exc:
                why = f"the gradient buckets of a refused request failed ({type(exc).__name__}: {exc})"
        self.drop_overlap()
        return why

    def grads_finite(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """A bool 0-d device tensor: every ``.grad`` accumulated so far is finite (this rank's, which under
        replication is the whole local gradient). One fused reduction; no collective here."""
        grads = _local_grads(params)
        return count_non_finite(grads, _device(params)) == 0


class ReplicatedSync(GradientSync):
    """Every rank holds the whole model: SUM over DP×CP in flat buckets (with the canary), norm local."""

    def __init__(self, invariant: GradientInvariant, group: Callable[[], dist.ProcessGroup | None] = lambda: None):
        """``group()``: the DP×CP group at the time of each request (None: one process, nothing to overlap)."""
        self.invariant = invariant
        self.group = group
        self.overlapped: OverlappedReduction | None = None

    def start_overlap(self, params: list[torch.nn.Parameter]) -> None:
        self.drop_overlap()
        group = self.group()
        if group is not None and dist.get_world_size(group) > 1:
            self.overlapped = OverlappedReduction(params, self.invariant.canary, group, faults=self.invariant.faults)

    def finish_overlap(self) -> None:
        if self.overlapped is not None:
            self.overlapped.finish()

    def drop_overlap(self) -> None:
        if self.overlapped is not None:
            self.overlapped.remove_hooks()
        self.overlapped = None

    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        """The reduction made during backward when it still holds on every rank (its ``matches()``, agreed by one
        MIN all-reduce of a flag over the DP×CP group: a rank whose gradient was edited since must not be the
        only one to reduce again), else the buckets now."""
        done, self.overlapped = self.overlapped, None
        group = self.group()
        if done is not None and done.group is not group:
            done = None  # the data groups were rebuilt since (a rank failed): reduce on the new ones
        ready = done is not None and done.matches()
        if group is not None and dist.get_world_size(group) > 1:
            flag = torch.tensor(int(ready), dtype=torch.int32, device=self.invariant.canary.device)
            ready = bool(all_reduce_(flag, group, dist.ReduceOp.MIN))
        self.invariant.reduce_and_check([p.grad for p in params], overlapped=done if ready else None)

    def norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        return sum_of_squares(_local_grads(params), _device(params)).sqrt()

    def norm_and_grad_bounds(self, params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
        """One read of each gradient for both: the bounds are each gradient's own L2 norm, from the same sweep
        (:func:`~ringtune.engine.tensor_norms.squares_and_norms`: no maxima taken); the norm is :meth:`norm`'s,
        bit for bit."""
        squares, norms = squares_and_norms(_grads_or_empty(params), _device(params))
        return squares.sqrt(), norms


class ExpertParallelSync(GradientSync):
    """EP > 1 with replicated parameters: non-expert gradients SUM over DP×CP, experts over their replica group;
    the norm adds the expert squares of the whole EP group (one all-reduce over ``mesh.ep_group``)."""

    name = "expert_parallel"

    def __init__(self, invariant: GradientInvariant, names: dict[int, str], mesh: ParallelMesh) -> None:
        self.invariant, self.names, self.mesh = invariant, names, mesh

    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        self.invariant.reduce_and_check(*expert_parallel.split(params, self.names))

    def norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        dense, expert = expert_parallel.split(params, self.names)
        device = _device(params)
        experts = sum_of_squares(expert, device)
        all_reduce_(experts, self.mesh.ep_group)
        return (sum_of_squares(dense, device) + experts).sqrt()


class FsdpSync(GradientSync):
    """FSDP2 (``dp`` / ``dp_cp``): gradients were SUMmed into their shards during backward; the canary is still
    reduced and checked, every unit resharded, and the norm SUMs the shards' squares over the shard group."""

    name = "fsdp"

    def __init__(self, invariant: GradientInvariant, units: list, shard_group: Callable[[], dist.ProcessGroup]):
        self.invariant, self.units, self.shard_group = invariant, units, shard_group

    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        self.invariant.reduce_and_check([])
        sharding.reshard_all(self.units)

    def norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        total = sum_of_squares(_local_grads(params), _device(params))
        all_reduce_(total, self.shard_group())
        return total.sqrt()

    def grads_finite(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """One verdict per DeviceMesh of the gradients, agreed over its sharded dimensions' groups (a non-finite
        value reduce-scattered into another rank's shard flags this rank's row too, as the DP×CP shards of
        one gradient and, under EP, the expert replicas); one all-reduce per such group."""
        by_mesh: dict[int, list[torch.Tensor]] = {}
        groups: dict[int, list[dist.ProcessGroup]] = {}
        for p in params:
            g = p.grad
            if g is None:
                continue
            key = id(getattr(g, "device_mesh", None))
            by_mesh.setdefault(key, []).append(local(g))
            if isinstance(g, DTensor) and key not in groups:
                groups[key] = [g.device_mesh.get_group(d) for d, pl in enumerate(g.placements) if pl.is_shard()]
        device = _device(params)
        bad = []
        for key, grads in by_mesh.items():
            count = count_non_finite(grads, device)
            for group in groups.get(key, []):
                all_reduce_(count, group)
            bad.append(count)
        return torch.stack(bad).sum() == 0 if bad else torch.ones((), dtype=torch.bool, device=device)


def gradient_sync_for(
    *,
    invariant: GradientInvariant,
    mesh: ParallelMesh | None,
    shard_params: str,
    fsdp_units: list,
    names: dict[int, str],
) -> GradientSync:
    """The strategy of a trainer's layout: FSDP when ``fsdp_units`` (sharded), EP when the mesh's EP size > 1
    (replicated), else replicated. The shard group is read from the mesh at each use (it is not rebuilt under
    FSDP, but the mesh is the one authority)."""
    if fsdp_units:
        assert mesh is not None  # sharding needs a mesh (the trainer refused None)
        return FsdpSync(invariant, fsdp_units, lambda: sharding.shard_group(mesh, shard_params).group)
    if expert_parallel.ep_size(mesh) > 1:
        assert mesh is not None
        return ExpertParallelSync(invariant, names, mesh)
    return ReplicatedSync(invariant, (lambda: mesh.dp_cp_group) if mesh is not None else (lambda: None))
