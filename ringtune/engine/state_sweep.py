"""One read of the trained state after AdamW for two checks: the replica checksums and the maxima the next step's
finite guard needs, so that the guard reads no weight or moment itself.

:func:`checksums_and_max_abs` reads each tensor once, in chunks of :data:`CHUNK_BYTES` that stay in cache: per chunk
the wrapping sum of its raw bits as integers of the element's own width (the replica check's checksum,
:mod:`ringtune.engine.replica_check`) and, where asked, its max |x| (NaN / inf propagated, as
:func:`~ringtune.engine.tensor_norms.max_abs`). Summing the chunks' sums in the same width wraps the same way
(addition modulo 2^width is associative), so the checksum equals the one-pass sum bit for bit.

:class:`StateMaxima` keeps those maxima, each with what identifies the exact state it was taken of: the tensor
object (a weak reference), its local storage address and its version counter (bumped by every in-place write:
AdamW, ``copy_`` of a checkpoint load, ``p[i] = x`` under ``no_grad``). :meth:`StateMaxima.lookup` gives them back
only for tensors unchanged since; the rest are read again. Recorded after the replica check's sweep, they are
the maxima of the state the next ``optim_step`` starts from (:func:`~ringtune.engine.update_guard.read_step_figures`).
"""

from __future__ import annotations

import weakref

import torch

from ringtune.engine.tensor_norms import local, max_abs

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_BYTES = 1 << 21
"""Bytes of one tensor read at a time (2 MiB: it stays in cache between the checksum and the maxima)."""


def _flat(t: torch.Tensor) -> torch.Tensor:
    x = local(t).detach().contiguous().reshape(-1)
    if x.is_complex() or x.element_size() not in _BITS:
        raise TypeError(f"cannot checksum a {x.dtype} tensor")
    return x


def checksums_and_max_abs(
    tensors: list[torch.Tensor], with_max: list[bool] | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor: its checksum (int64 ``[len]``: the wrapping sum of the raw bits as integers of the element's own
    width, sign-extended; DTensors through their local shard, a 0-d tensor as one element) and, where
    ``with_max[i]`` (None: every floating tensor), max |t| (float64 ``[len]``, 0 where not asked or empty; NaN / inf
    where the tensor holds one). Both on ``device``; nothing read back to the host. TypeError for a complex dtype."""
    sums, peaks = [], []
    for i, t in enumerate(tensors):
        x = _flat(t)
        bits = _BITS[x.element_size()]
        want = x.is_floating_point() and x.numel() > 0 and (with_max is None or with_max[i])
        step = max(1, CHUNK_BYTES // x.element_size())
        chunk_sums, chunk_peaks = [], []
        for start in range(0, max(x.numel(), 1), step):
            chunk = x[start : start + step]
            chunk_sums.append(chunk.view(bits).sum(dtype=bits))
            if want:
                low, high = torch.aminmax(chunk)
                chunk_peaks.append(torch.maximum(-low, high))
        total = chunk_sums[0] if len(chunk_sums) == 1 else torch.stack(chunk_sums).sum(dtype=bits)
        sums.append(total.to(device, torch.int64))
        if want:
            peak = chunk_peaks[0] if len(chunk_peaks) == 1 else torch.stack(chunk_peaks).amax()
            peaks.append(peak.to(device, torch.float64))
        else:
            peaks.append(torch.zeros((), dtype=torch.float64, device=device))
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack(sums), torch.stack(peaks)


def _state_of(t: torch.Tensor) -> tuple[int, int, int]:
    """What a maximum of ``t`` was taken of: its local storage address, element count and version counter."""
    x = local(t.detach())
    return x.data_ptr(), x.numel(), x._version


class StateMaxima:
    """Maxima of the weights and AdamW moments, each valid while its tensor is the same object, at the same
    storage, unchanged (version counter); see the module docstring. Local, no collective."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, tuple[int, int, int], int]] = {}
        self._values: torch.Tensor | None = None

    def record(self, tensors: list[torch.Tensor], maxima: torch.Tensor) -> None:
        """Remember ``maxima[i]`` (float64 ``[len(tensors)]``, taken just now) as max |tensors[i]|; forgets what was
        recorded before."""
        self._values = maxima
        self._known = {id(t): (weakref.ref(t), _state_of(t), i) for i, t in enumerate(tensors)}

    def forget(self) -> None:
        """Drop every recorded maximum (e.g. a checkpoint was loaded)."""
        self._known, self._values = {}, None

    def lookup(self, tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
        """max |t| per tensor (float64 ``[len]`` on ``device``, 0 for an empty one): recorded values where the
        tensor is unchanged since :meth:`record`, the others read now (:func:`max_abs`, one fused pass over just
        those). The values equal :func:`max_abs` of ``tensors`` either way."""
        where, fresh, slots = [], [], []
        for i, t in enumerate(tensors):
            seen = self._known.get(id(t))
            if seen is None or seen[0]() is not t or seen[1] != _state_of(t):
                where.append(i)
                fresh.append(local(t.detach()))
                slots.append(0)  # a placeholder, overwritten below
            else:
                slots.append(seen[2])
        if len(where) == len(tensors):
            return max_abs(fresh, device)
        assert self._values is not None
        out = self._values[torch.tensor(slots, dtype=torch.int64, device=self._values.device)].to(device)
        if where:
            out[torch.tensor(where, device=device)] = max_abs(fresh, device)
        return out
