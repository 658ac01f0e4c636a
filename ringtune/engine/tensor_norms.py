"""Fused reductions over lists of tensors that stay on the device (no host sync): the optimizer step's grad norm,
finite checks and update guard read them back together, once.

Every function takes plain tensors (a DTensor's local shard: the caller passes ``to_local()``) on one device and
returns a tensor on that device; ``device`` is used when the list is empty. ``torch._foreach_norm`` runs one
kernel per device and dtype group instead of one reduction and one ``float()`` per tensor (on CUDA; on CPU the
maxima take ``torch.aminmax``, see :func:`max_abs`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP-sharded parameter, gradient or moment); ``t`` otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


CHUNK_ELEMENTS = 1 << 19
"""Elements of a non-float64 CPU tensor widened to float64 at a time by :func:`sum_of_squares` (a 4 MiB float64
buffer, reused: it stays in cache, where widening the whole tensor at once writes and re-reads twice its bytes)."""


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Σ_t Σ_i t_i², a float64 0-d tensor: each tensor's sum of squares accumulated in float64, summed. Non-finite
    elements give inf / NaN. 0 for an empty list.

    float64 tensors, and every tensor on CUDA: each tensor's L2 norm by ``_foreach_norm(dtype=float64)`` (one fused
    kernel on CUDA), squared and summed. Other dtypes on the CPU, where that op widens each whole tensor to a fresh
    float64 copy (about 4-9x a float32 norm): :func:`_widened_sweep` (the same float64 arithmetic in another order:
    equal to float64 rounding, ~1e-13 relative over 1e8 elements).
    """
    return _squares(tensors, device, maxima=False)[0]


def squares_and_max_abs(
    tensors: list[torch.Tensor], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_of_squares(tensors), max_abs(tensors))``, bit for bit, reading each narrower CPU tensor once: its
    maxima are taken chunk by chunk while :func:`_widened_sweep` has the chunk in cache."""
    total, peaks, _ = _squares(tensors, device, maxima=True)
    assert peaks is not None
    return total, peaks


def squares_and_norms(
    tensors: list[torch.Tensor], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_of_squares(tensors)`` (bit for bit) and each tensor's own L2 norm (float64 ``[len(tensors)]``, 0 for
    an empty one), from the same read and the same float64 arithmetic: an upper bound of each tensor's max |t_i|
    (equal to it up to the last bits of rounding when one element dominates), non-finite where the tensor holds a
    non-finite element (or, in float64, where its squares overflow). Costs the sum of squares alone, no maxima."""
    total, _, per_tensor = _squares(tensors, device, maxima=False)
    return total, per_tensor.sqrt()


def _squares(
    tensors: list[torch.Tensor], device: torch.device | str, *, maxima: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The sum of squares, (``maxima``) the per-tensor max |t_i| of :func:`squares_and_max_abs`, and each tensor's
    own float64 sum of squares (``[len(tensors)]`` on ``device``, 0 for an empty tensor)."""
    nonempty = [t.detach() for t in tensors if t.numel() > 0]
    where = [i for i, t in enumerate(tensors) if t.numel() > 0]
    peaks = torch.zeros(len(tensors), dtype=torch.float64, device=device) if maxima else None
    own = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    if not nonempty:
        return torch.zeros((), dtype=torch.float64, device=device), peaks, own
    wide = [not (t.dtype == torch.float64 or t.device.type != "cpu") for t in nonempty]
    native = [t for t, w in zip(nonempty, wide, strict=True) if not w]
    parts = []
    native_squares: list[torch.Tensor] = []
    if native:
        norms = torch._foreach_norm(native, 2, dtype=torch.float64)
        squared = torch.stack([n.to(nonempty[0].device) for n in norms]).square()
        parts.append(squared.sum())
        native_squares = list(squared.to(device))
    widened = [t for t, w in zip(nonempty, wide, strict=True) if w]
    wide_peaks = None
    wide_squares: list[torch.Tensor] = []
    if widened:
        total, wide_peaks, wide_sums = _widened_sweep(widened, maxima=maxima)
        parts.append(total.to(nonempty[0].device))
        wide_squares = list(wide_sums.to(device))
    squares_in_order = iter(native_squares), iter(wide_squares)
    own[torch.tensor(where, device=device)] = torch.stack([next(squares_in_order[w]) for w in wide])
    if peaks is not None:  # back into the order of ``tensors``: native ones by max_abs, widened ones by the sweep
        native_peaks, widened_peaks = iter(max_abs(native, device)), iter(wide_peaks if widened else [])
        values = [next(widened_peaks) if w else next(native_peaks) for w in wide]
        peaks[torch.tensor(where, device=device)] = torch.stack([v.to(device, torch.float64) for v in values])
    return (parts[0] if len(parts) == 1 else torch.stack(parts).sum()), peaks, own


def _widened_sweep(
    tensors: list[torch.Tensor], *, maxima: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Σ t_i² over CPU tensors of a narrower float dtype, each element widened to float64 (exact) and squared and
    summed in float64, :data:`CHUNK_ELEMENTS` at a time through one reused buffer (``copy_`` widens, ``dot`` sums
    the squares): a float64 0-d CPU tensor (the chunks' sums summed at once, in order); with ``maxima`` also each
    tensor's max |t_i| (float64 ``[len]``, NaN / inf propagated as by :func:`max_abs`), from ``aminmax`` of each
    chunk while it is in cache; and each tensor's own sum of squares (float64 ``[len]``, its chunks' sums)."""
    buffer = torch.empty(min(CHUNK_ELEMENTS, max(t.numel() for t in tensors)), dtype=torch.float64, device="cpu")
    partial = []
    peaks = []
    own = []
    for t in tensors:
        flat = t.reshape(-1)
        chunk_peaks = []
        first = len(partial)
        for start in range(0, flat.numel(), CHUNK_ELEMENTS):
            chunk = flat[start : start + CHUNK_ELEMENTS]
            wide = buffer[: chunk.numel()]
            wide.copy_(chunk)
            partial.append(torch.dot(wide, wide))
            if maxima:
                low, high = torch.aminmax(chunk)
                chunk_peaks.append(torch.maximum(-low, high))
        own.append(partial[first] if len(partial) == first + 1 else torch.stack(partial[first:]).sum())
        if maxima:
            peak = torch.stack(chunk_peaks).amax() if len(chunk_peaks) > 1 else chunk_peaks[0]
            peaks.append(peak.to(torch.float64))
    return torch.stack(partial).sum(), (torch.stack(peaks) if maxima else None), torch.stack(own)


def max_abs(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Per tensor, max |t_i| as float64 ``[len(tensors)]`` (0 for an empty tensor); NaN where the tensor holds a
    NaN and inf where it holds an inf (the max propagates both), so ``isfinite`` of it is the tensor's finite check.

    On CUDA one ``_foreach_norm(ord=inf)`` per device and dtype group; on CPU, where that op is not vectorised
    (about 15x slower than a float32 L2 norm), ``torch.aminmax`` per tensor (one vectorised pass each).
    """
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    where = [i for i, t in enumerate(tensors) if t.numel() > 0]
    if not where:
        return out
    chosen = [tensors[i].detach() for i in where]
    if all(t.device.type == "cuda" for t in chosen):
        maxima = list(torch._foreach_norm(chosen, float("inf")))
    else:
        maxima = []
        for t in chosen:
            low, high = torch.aminmax(t)
            maxima.append(torch.maximum(-low, high))
    out[torch.tensor(where, device=device)] = torch.stack([m.to(device, torch.float64) for m in maxima])
    return out


def count_non_finite(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """How many of ``tensors`` hold a NaN or an inf: a float64 0-d tensor (a count, exact; summable over ranks)."""
    return (~torch.isfinite(max_abs(tensors, device))).sum(dtype=torch.float64)
