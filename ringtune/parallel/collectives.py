"""Autograd-aware collectives over an explicit process group.

Each forward has the matching backward: all-gather <-> reduce-scatter (SUM), all-to-all <-> the
all-to-all with counts swapped, ring shift <-> the reverse ring shift. All operate on dim 0 of a
contiguous tensor and report their bytes to :mod:`ringtune.parallel.meter`. With a group of size 1 every
one is the identity (no communication).

Host staging: a gloo group cannot move CUDA tensors through send/recv or its tensor collectives (it hands the
data pointer to a host transport), and NCCL refuses two ranks on one GPU. So when a tensor's device type is in
:data:`HOST_STAGED_DEVICES` and the group is gloo, each op here copies it to host memory, communicates there and
copies the result back (:func:`host_staged`). That is what lets CP=2 run as two processes on one GPU
(``benchmarks/gpu_cp2.py``): slow, but the same arithmetic on the device. NCCL groups never stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringtune.parallel.meter import record_sent

HOST_STAGED_DEVICES: set[str] = {"cuda"}
"""Device types whose tensors a gloo group moves through host memory (module docstring)."""


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def group_device_error(device_type: str, backend: str) -> str | None:
    """Why a tensor on ``device_type`` cannot go through a group of ``backend`` (None: it can). The rule of the one
    device authority (docs/gpu.md "Device placement"): an NCCL group moves CUDA tensors only; a gloo group moves CPU
    tensors, and those of :data:`HOST_STAGED_DEVICES` through host memory."""
    if backend == "nccl" and device_type != "cuda":
        return f"a {device_type} tensor on a nccl group: NCCL moves CUDA tensors only (the mesh's device)"
    if backend == "gloo" and device_type != "cpu" and device_type not in HOST_STAGED_DEVICES:
        return f"a {device_type} tensor on a gloo group: gloo moves CPU tensors (and stages CUDA ones through the host)"
    return None


def host_staged(x: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """True when ``x`` goes through ``group`` by way of host memory (a gloo group, a device in
    :data:`HOST_STAGED_DEVICES`). Every collective of this module asks this first, so it also enforces
    :func:`group_device_error`'s rule: ValueError for a tensor the group cannot move, before any rank sends."""
    backend = str(dist.get_backend(group))
    error = group_device_error(x.device.type, backend)
    if error is not None:
        raise ValueError(f"{error}; shape {tuple(x.shape)}, dtype {x.dtype}")
    return x.device.type in HOST_STAGED_DEVICES and backend == dist.Backend.GLOO


def _staged(run, x: torch.Tensor, group: dist.ProcessGroup, *args, **kwargs) -> torch.Tensor:
    """``run(x, group, ...)`` on a host copy of ``x`` and the result copied back to ``x``'s device when
    :func:`host_staged`, else ``run`` itself."""
    if not host_staged(x, group):
        return run(x, group, *args, **kwargs)
    return run(x.to("cpu", copy=True), group, *args, **kwargs).to(x.device, copy=True)


def all_reduce_(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM):
    """In-place all-reduce of ``x`` over ``group`` (``op``, SUM by default), host-staged where needed; returns ``x``."""
    if not host_staged(x, group):
        dist.all_reduce(x, op=op, group=group)
        return x
    host = x.to("cpu", copy=True)
    dist.all_reduce(host, op=op, group=group)
    return x.copy_(host)


def all_gather_raw(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n, ...] on each rank -> [size·n, ...] (rank order). No autograd."""
    return _staged(_all_gather, x, group)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    record_sent("all_gather", *([x] * (size - 1)))
    dist.all_gather_single(out, x, group=group)
    return out


def reduce_scatter_raw(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[size·n, ...] on each rank -> [n, ...]: this rank's block of the SUM over ranks. No autograd."""
    return _staged(_reduce_scatter, x, group)


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter needs dim 0 ({x.shape[0]}) divisible by the group size {size}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    rank = dist.get_rank(group)
    blocks = x.chunk(size)
    record_sent("reduce_scatter", *(b for i, b in enumerate(blocks) if i != rank))
    dist.reduce_scatter_single(out, x, group=group)
    return out


def all_to_all_raw(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    send_counts: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
    *,
    op: str = "all_to_all",
) -> torch.Tensor:
    """Send block i of ``x`` (dim 0, sizes ``send_counts``, equal if None) to rank i; receive in rank order.

    ``op``: the name the bytes sent are recorded under (:func:`ringtune.parallel.meter.record_sent`).
    """
    return _staged(_all_to_all, x, group, send_counts, recv_counts, op=op)


def _all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    send_counts: Sequence[int] | None,
    recv_counts: Sequence[int] | None,
    *,
    op: str,
) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    x = x.contiguous()
    if send_counts is None:
        if x.shape[0] % size:
            raise ValueError(f"all_to_all needs dim 0 ({x.shape[0]}) divisible by the group size {size}")
        send_counts = [x.shape[0] // size] * size
    if recv_counts is None:
        recv_counts = list(send_counts)
    rank = dist.get_rank(group)
    blocks = x.split(list(send_counts))
    record_sent(op, *(b for i, b in enumerate(blocks) if i != rank))
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x, list(recv_counts), list(send_counts), group=group)
    return out


class _AdjointPair(torch.autograd.Function):
    """A collective ``forward_raw(x, group)`` whose backward is its adjoint ``backward_raw(grad, group)``
    (all-gather <-> reduce-scatter SUM on dim 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, forward_raw, backward_raw) -> torch.Tensor:
        ctx.group, ctx.backward_raw = group, backward_raw
        return forward_raw(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_raw(grad, ctx.group), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts, op, back_op):
        ctx.group, ctx.send_counts, ctx.recv_counts, ctx.back_op = group, send_counts, recv_counts, back_op
        return all_to_all_raw(x, group, send_counts, recv_counts, op=op)

    @staticmethod
    def backward(ctx, grad):
        recv = ctx.recv_counts if ctx.recv_counts is not None else ctx.send_counts
        return all_to_all_raw(grad, ctx.group, recv, ctx.send_counts, op=ctx.back_op), None, None, None, None, None


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, shift):
        ctx.group, ctx.shift = group, shift
        return ring_shift_raw(x, group, shift)

    @staticmethod
    def backward(ctx, grad):
        return ring_shift_raw(grad, ctx.group, -ctx.shift), None, None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather on dim 0: [n, ...] -> [size·n, ...]; backward reduce-scatters (SUM)."""
    return _AdjointPair.apply(x, group, all_gather_raw, reduce_scatter_raw)


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable reduce-scatter (SUM) on dim 0: [size·n, ...] -> [n, ...]; backward all-gathers."""
    return _AdjointPair.apply(x, group, reduce_scatter_raw, all_gather_raw)


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    send_counts: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
    *,
    op: str = "all_to_all",
    back_op: str = "all_to_all",
) -> torch.Tensor:
    """Differentiable all-to-all on dim 0 with optional uneven counts; backward is the swapped all-to-all.

    ``op`` / ``back_op``: the meter names of the forward's and the backward's bytes sent.
    """
    return _AllToAll.apply(
        x,
        group,
        None if send_counts is None else tuple(send_counts),
        None if recv_counts is None else tuple(recv_counts),
        op,
        back_op,
    )


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup, shift: int = 1) -> torch.Tensor:
    """Differentiable ring shift: rank r receives rank (r-shift)'s ``x``; backward sends grads the other way.

    Every rank must pass a tensor of the same shape and dtype.
    """
    return _RingShift.apply(x, group, shift)


class RingExchange:
    """Asynchronous ring P2P over ``group``: post a send to rank r+1 and a receive from rank r-1.

    Used by ring attention to overlap the K/V transfer with the block compute:
    ``pending = ring.start(kv); ...compute...; kv = ring.finish(pending)``. ``reverse=True`` runs the
    ring the other way (r sends to r-1, receives from r+1).
    """

    def __init__(self, group: dist.ProcessGroup, *, reverse: bool = False) -> None:
        self.group = group
        self.size = _size(group)
        rank = dist.get_rank(group)
        step = -1 if reverse else 1
        self.send_peer = dist.get_global_rank(group, (rank + step) % self.size)
        self.recv_peer = dist.get_global_rank(group, (rank - step) % self.size)

    def start(self, tensor: torch.Tensor, *, tag: int = 0) -> tuple[torch.Tensor, list, torch.device]:
        """Post the exchange of ``tensor``; returns what :meth:`finish` needs.

        Exchanges with different ``tag`` may be in flight together; every rank must post the same
        sequence of exchanges with tensors of the same shape and dtype.
        """
        device = tensor.device
        record_sent("ring", tensor)
        tensor = tensor.to("cpu", copy=True) if host_staged(tensor, self.group) else tensor.contiguous()
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.send_peer, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.recv_peer, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        return recv, [*works, tensor], device  # the send buffer stays alive until the wait

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list, torch.device]) -> torch.Tensor:
        """Wait for the exchange and return the tensor received from the previous rank (on the sent tensor's
        device: a host-staged exchange copies it back)."""
        recv, works, device = pending
        for work in works:
            if isinstance(work, dist.Work):
                work.wait()
        return recv if recv.device == device else recv.to(device, copy=True)


def ring_shift_raw(x: torch.Tensor, group: dist.ProcessGroup, shift: int) -> torch.Tensor:
    """Non-differentiable ring shift by ``shift`` (±1): rank r receives rank (r-shift)'s tensor."""
    if _size(group) == 1 or shift % _size(group) == 0:
        return x
    if shift not in (1, -1):
        raise ValueError(f"ring shift supports ±1, got {shift}")
    ring = RingExchange(group, reverse=shift < 0)
    return ring.finish(ring.start(x))
