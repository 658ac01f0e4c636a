"""Replicated gradients all-reduced in buckets while backward still runs (as DDP does), bit for bit the reduction
:meth:`~ringtune.engine.gradients.GradientInvariant.reduce_and_check` would run at ``optim_step``.

When a ``forward_backward`` is the first request since the last optimizer step (no gradient accumulated before
it), its gradients are the step's whole gradient. :class:`OverlappedReduction` is then armed before the request's
last microbatch: a post-accumulate-grad hook on every trainable parameter and on the gradient canary marks it
ready when backward has written its last contribution, and every bucket whose members are all ready is packed
(a copy: the local ``.grad`` stays this rank's, for the per-microbatch finite check and the all-or-nothing
agreement) and all-reduced asynchronously over the DP×CP group while backward goes on with earlier layers.

- **Same buckets, same bits**: the buckets are :func:`~ringtune.engine.gradients.bucket_indices` of the list
  ``reduce_and_check`` reduces (every parameter's gradient in order, then the canary), a missing gradient packed
  as the zeros ``optim_step`` would give it; so each flat buffer holds what ``reduce_gradients`` would reduce
  at ``optim_step``, and the reduced values are the same bits.
- **Same order on every rank**: buckets are launched strictly from the last to the first (the order backward
  makes them ready in), a ready bucket waiting for the later ones; what is still unlaunched when the request's
  microbatches end (parameters without a gradient here) is launched then, in that order. Every rank issues the
  same collectives in the same order whatever its hooks saw.
- **Waited for once the ranks agreed**: :meth:`finish` launches what is left and waits, after the request's
  agreement (:func:`~ringtune.engine.request_guard.settle_request`): on success every rank launched the same
  buckets; on a refusal the ranks agreed on, they are still finished so the group stays in step; when a rank
  raised, the data groups are rebuilt and what was pending on the old ones is dropped (a failed peer does not
  keep the others waiting for buckets it never sent).
- **Used only if still true**: each packed gradient's identity and version counter are recorded; :meth:`matches`
  at ``optim_step`` accepts the reduced buffers only if the canary's gradient and every packed gradient are the
  same tensors at the same versions (a later request, a refused step, a load, a fault that edits a gradient all
  change one of them), on every rank (:meth:`~ringtune.engine.grad_sync.ReplicatedSync.reduce` agrees on it with
  one MIN all-reduce of a flag); otherwise the step reduces as before, at ``optim_step``.

Memory: the reduced buffers (one copy of the replicated gradients) are held from the request's end until
``optim_step`` or the next request. Collectives per step: one all-reduce per bucket, as before, issued during the
last microbatch's backward instead of in ``optim_step``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringtune.debug_faults import NO_FAULTS, FaultHooks
from ringtune.engine.gradients import BUCKET_BYTES, bucket_indices, unpack_bucket
from ringtune.parallel.collectives import host_staged


class OverlappedReduction:
    """One request's bucketed all-reduce of ``params``' gradients and the canary, launched from backward hooks.

    Args:
        params: the trainer's trainable parameters (replicated over ``group``), in the order ``optim_step``
            reduces their gradients.
        canary: the gradient invariant's float64 leaf (its gradient is reduced in the last bucket, as
            ``reduce_and_check`` appends it).
        group: the DP×CP group (gloo or NCCL; a gloo group on CUDA tensors is staged through host memory).
        faults: the ``average_over_group`` negative control divides each reduced bucket by the group size, as
            :func:`~ringtune.engine.gradients.reduce_gradients` does.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        canary: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        faults: FaultHooks = NO_FAULTS,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.leaves = [*params, canary]
        self.group = group
        self.faults = faults
        self.buckets = bucket_indices(self.leaves, bucket_bytes)
        self.ready = [False] * len(self.leaves)
        self.next_bucket = len(self.buckets) - 1  # launched from the last bucket down to the first
        self.flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.works: list = [None] * len(self.buckets)
        self.packed: list[tuple[int, int] | None] = [None] * len(self.leaves)  # (id, version) of each packed grad
        self.launched_in_backward = 0
        self.mismatched = False  # a gradient of another dtype or shape than its parameter: not optim_step's buckets
        self.wait_s = 0.0
        self._hooks = [
            leaf.register_post_accumulate_grad_hook(self._hook(i))
            for i, leaf in enumerate(self.leaves)
            if leaf.requires_grad
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """The hook of leaf ``index``: mark it ready, launch every bucket that is now next and complete."""

        def ready(_leaf: torch.Tensor) -> None:
            self.ready[index] = True
            while self.next_bucket >= 0 and all(self.ready[i] for i in self.buckets[self.next_bucket]):
                self._launch(self.next_bucket)
                self.launched_in_backward += 1

        return ready

    def _launch(self, b: int) -> None:
        """Pack bucket ``b`` (a copy; a missing gradient as zeros) and start its all-reduce."""
        parts = []
        for i in self.buckets[b]:
            leaf = self.leaves[i]
            grad = leaf.grad
            if grad is None:
                parts.append(torch.zeros(leaf.numel(), dtype=leaf.dtype, device=leaf.device))
            else:
                self.mismatched |= grad.dtype != leaf.dtype or grad.shape != leaf.shape
                parts.append(grad.detach().reshape(-1).to(leaf.dtype))
                self.packed[i] = (id(grad), grad._version)
        flat = torch.cat(parts)
        if host_staged(flat, self.group):
            flat = flat.to("cpu")
        self.flats[b] = flat
        self.works[b] = dist.all_reduce(flat, group=self.group, async_op=True)
        self.next_bucket = b - 1

    def finish(self) -> None:
        """Remove the hooks, launch the buckets backward left (in order), wait for every all-reduce. Collective
        over ``group`` (every rank launches the same buckets in the same order)."""
        self.remove_hooks()
        while self.next_bucket >= 0:
            self._launch(self.next_bucket)
        start = time.perf_counter()
        size = dist.get_world_size(self.group)
        for b, work in enumerate(self.works):
            work.wait()
            if self.faults.active("average_over_group"):  # DEBUG-FAULT HOOK (negative control; no-op)
                self.flats[b] /= size
        self.wait_s = time.perf_counter() - start

    def remove_hooks(self) -> None:
        """Detach the hooks (idempotent); a request that fails before :meth:`finish` calls this."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def matches(self) -> bool:
        """Whether every gradient packed (and the canary's) is still the tensor it was, unchanged since: then the
        reduced buffers are the SUM ``optim_step`` would compute. A parameter packed without a gradient may
        have one now only from ``optim_step``'s zero fill (anything else that gives it one also replaces the
        canary's gradient, which must match)."""
        if self.mismatched or self.next_bucket >= 0 or self.packed[-1] is None:
            return False
        for leaf, packed in zip(self.leaves, self.packed, strict=True):
            grad = leaf.grad
            if packed is None:
                continue
            if grad is None or (id(grad), grad._version) != packed:
                return False
        return True

    def unpack(self, grads: list[torch.Tensor], canary_grad: torch.Tensor) -> None:
        """Write the reduced values into ``grads`` (every parameter's, in ``params`` order) and ``canary_grad``
        (a copy of the canary's gradient), as ``reduce_gradients`` leaves them."""
        targets = [*grads, canary_grad]
        for b, bucket in enumerate(self.buckets):
            flat = self.flats[b]
            unpack_bucket(flat.to(targets[bucket[0]].device), [targets[i] for i in bucket])
