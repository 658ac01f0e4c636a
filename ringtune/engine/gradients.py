"""Gradient reduction over DP×CP with its invariant check (SUM, never a mean, never scaled by microbatches).

Every microbatch loss gets ``+ canary`` (a zero-valued float64 leaf): after backward the canary's gradient
counts the microbatches this rank ran, scaled by whatever scaling the loss path applied. Reduced by the
same function as the gradients, it must equal the total number of microbatches over the DP×CP group,
exactly. Averaging over the group, dividing the loss by the microbatch count, or reducing over the wrong
group all change it, and :meth:`GradientInvariant.check` fails loudly.

Expert parallelism: a routed expert's parameters live on one rank of each EP group and are replicated over
the (DP·CP)/EP ranks of its **expert replica group** (``ParallelMesh.expert_replica_group``); every token
routed to the expert, from any rank, made its gradient contribution on that rank (the dispatch brought it
there), so the exact SUM over every token is the SUM over the expert replica group. A second copy of the
canary is reduced with the expert gradients over that group and must equal microbatches x its size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.parallel.collectives import all_reduce_


class GradientInvariantError(RuntimeError):
    """A gradient reduction scaled what must be a plain SUM (a bug, never a user error)."""


BUCKET_BYTES = 25 * 2**20
"""The largest flat buffer :func:`reduce_gradients` all-reduces at once (DDP's default bucket size): the
collectives per step are about the gradients' bytes / this, and the transient is one bucket (and its copy)."""


def bucket_indices(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors``, in order, cut into runs of one dtype and device of at most ``bucket_bytes`` each (a
    tensor larger than that is a bucket of its own). Reads only dtype, device and size (a parameter stands for
    its gradient)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        bytes_ = t.numel() * t.element_size()
        last = tensors[buckets[-1][0]] if buckets else None
        if last is None or (last.dtype, last.device) != (t.dtype, t.device) or size + bytes_ > bucket_bytes:
            buckets.append([i])
            size = bytes_
        else:
            buckets[-1].append(i)
            size += bytes_
    return buckets


def gradient_buckets(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``tensors`` cut as :func:`bucket_indices` cuts them."""
    return [[tensors[i] for i in bucket] for bucket in bucket_indices(tensors, bucket_bytes)]


def pack_bucket(bucket: list[torch.Tensor]) -> torch.Tensor:
    """The flat buffer one bucket is all-reduced in: the tensor itself when it is alone and contiguous (reduced in
    place), else a concatenation of the flattened tensors (a copy)."""
    return bucket[0] if _in_place(bucket) else torch.cat([t.reshape(-1) for t in bucket])


def unpack_bucket(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    """Copy the reduced ``flat`` (from :func:`pack_bucket` of a bucket of the same shapes) into ``bucket``'s
    tensors; nothing to do where ``flat`` is the bucket's one tensor (reduced in place)."""
    if flat is bucket[0]:
        return
    for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
        t.copy_(part.view_as(t))


def _in_place(bucket: list[torch.Tensor]) -> bool:
    return len(bucket) == 1 and bucket[0].is_contiguous()


def reduce_gradients(
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    faults: FaultHooks = NO_FAULTS,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """In place: SUM each tensor over ``group`` (the DP×CP group); None or size 1 = nothing to do.

    The tensors travel in flat buckets (:func:`gradient_buckets`): one all-reduce per bucket, not per tensor.
    Each element is still the plain SUM of its ranks' values (an elementwise reduction of a concatenation), so
    replicas receive identical bits, as with one all-reduce per tensor. ``faults``: the ``average_over_group``
    negative control divides by the group size (:mod:`ringtune.debug_faults`).
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    for bucket in gradient_buckets(tensors, bucket_bytes):
        flat = pack_bucket(bucket)
        all_reduce_(flat, group)
        if faults.active("average_over_group"):  # DEBUG-FAULT HOOK (negative control; no-op)
            flat /= dist.get_world_size(group)
        unpack_bucket(flat, bucket)


class GradientInvariant:
    """The canary that proves the gradient path is a plain SUM over microbatches and DP×CP ranks."""

    def __init__(
        self,
        group: Callable[[], dist.ProcessGroup | None],
        *,
        faults: FaultHooks = NO_FAULTS,
        expert_group: Callable[[], dist.ProcessGroup | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """``group()`` gives the DP×CP group at the time of each reduction (the mesh may rebuild it);
        ``expert_group()`` the expert replica group (None: no expert-parallel parameters); ``device``: the
        parameters' (the canary's gradient is reduced with theirs, over the data groups: NCCL on CUDA). ``faults``:
        the debug-fault hooks (:mod:`ringtune.debug_faults`) of the negative controls that act here
        (``average_over_group``, ``scale_by_microbatches``, ``experts_over_dp_cp``, ``gradients_averaged``)."""
        self._group = group
        self._expert_group = expert_group
        current = group()
        self.group_size = 1 if current is None else dist.get_world_size(current)
        expert = None if expert_group is None else expert_group()
        self.expert_group_size = 1 if expert is None else dist.get_world_size(expert)
        self.faults = faults
        self.canary = torch.zeros((), dtype=torch.float64, device=device, requires_grad=True)
        self.expected = 0

    def loss_term(self) -> torch.Tensor:
        """Add this to every microbatch loss, before any scaling (value exactly 0)."""
        return self.canary

    def scale_loss(self, loss: torch.Tensor, microbatches: int) -> torch.Tensor:
        """The loss as backpropagated: itself (a fault may scale it, to show the check catches it)."""
        return loss / microbatches if self.faults.active("scale_by_microbatches") else loss  # DEBUG-FAULT HOOK

    def count(self, microbatches_per_rank: int) -> None:
        """Record that every rank of the group ran ``microbatches_per_rank`` microbatches."""
        self.expected += microbatches_per_rank * self.group_size

    def take(self) -> tuple[torch.Tensor | None, int]:
        """Set aside what has been accumulated (canary gradient, expected count) and start from zero."""
        saved = (self.canary.grad, self.expected)
        self.canary.grad = None
        self.expected = 0
        return saved

    def restore(self, saved: tuple[torch.Tensor | None, int]) -> None:
        """Drop what was accumulated since :meth:`take` and put ``saved`` back (a refused request)."""
        self.canary.grad, self.expected = saved

    def merge(self, saved: tuple[torch.Tensor | None, int]) -> None:
        """Add ``saved`` (from :meth:`take`) to what was accumulated since (a request that succeeded)."""
        grad, expected = saved
        if grad is not None:
            self.canary.grad = grad if self.canary.grad is None else grad + self.canary.grad
        self.expected += expected

    def reset(self) -> None:
        """Forget everything accumulated (the gradients were dropped)."""
        self.take()

    def reduce_and_check(
        self, grads: list[torch.Tensor], expert_grads: list[torch.Tensor] | tuple = (), *, overlapped=None
    ) -> None:
        """Reduce ``grads`` and the canary together over the group, ``expert_grads`` and a copy of the canary
        over the expert replica group, then require each canary == microbatches x its group's size.

        ``overlapped``: an :class:`~ringtune.engine.grad_overlap.OverlappedReduction` that already reduced exactly
        ``grads`` and the canary during backward (its ``matches()`` held): its buffers are copied in instead of
        reducing again (the same bits); the check is the same."""
        if expert_grads and self._expert_group is None:
            raise ValueError("expert_grads given but this invariant has no expert_group")
        canary = self.canary.grad
        if canary is None:
            canary = torch.zeros((), dtype=torch.float64, device=self.canary.device)
        canary = canary.detach().clone()
        expert_canary = canary.clone()
        if overlapped is not None:
            overlapped.unpack(grads, canary)
        else:
            reduce_gradients([*grads, canary], self._group(), faults=self.faults)
        checks = [(float(canary), float(self.expected), "DP·CP ranks")]
        if self._expert_group is not None:
            wrong = self.faults.active("experts_over_dp_cp")  # DEBUG-FAULT HOOK (negative control; no-op)
            group = self._group() if wrong else self._expert_group()
            reduce_gradients([*expert_grads, expert_canary], group, faults=self.faults)
            want = self.expected // self.group_size * self.expert_group_size
            checks.append((float(expert_canary), float(want), "expert replicas ((DP·CP)/EP ranks)"))
        self.canary.grad = None
        self.expected = 0
        for got, want, ranks in checks:
            if got != want:
                raise GradientInvariantError(
                    f"gradient invariant violated: the canary summed to {got}, expected {want} (= microbatches x "
                    f"{ranks}); a reduction averaged over the group, ran over the wrong group, or the loss was "
                    "scaled by the microbatch count"
                )
        self.faults.scale_reduced_gradients(grads, self.group_size)  # DEBUG-FAULT HOOK (parity negative control; no-op)

    def startup_check(self) -> None:
        """Run two canary-only microbatches through backward and the reduction; raises if it is not a SUM."""
        for _ in range(2):
            self.scale_loss(self.loss_term(), 2).backward()
        self.count(2)
        self.reduce_and_check([])
