"""The log-prob head kernels timed against each other (``gpu_check.py`` part 4): ``tiled`` vs Liger's fused
linear cross-entropy at the Qwen3.5-4B head's size, forward + backward, time and memory in one run.

Why: ``models/head_kernels.py`` keeps ``tiled`` the default until a GPU run shows ``liger`` faster at equal memory
(issue 19); this measures exactly that. Inputs as bf16-mixed gives them to the head: the final norm's float32
output ``hidden`` [T, D] and the float32 output weight [V, D] (the head stays float32 under bf16-mixed), labels
[T] with every 7th ignored, a random upstream gradient [T]. Per kernel and token count: the median of
``repeats`` forward + backward times after one warm-up, and the peak memory above what the inputs hold
(``torch.cuda.max_memory_allocated`` after a reset). On CPU (``--smoke``) only ``tiled`` runs, at tiny sizes.
"""

from __future__ import annotations

import statistics
import time

import torch

from ringtune.models.head_kernels import liger_available, liger_label_logprobs
from ringtune.models.logprob_head import label_logprobs
from ringtune.plan.models import KNOWN_MODELS

HEAD_4B = (KNOWN_MODELS["Qwen3.5-4B"]["hidden_size"], KNOWN_MODELS["Qwen3.5-4B"]["vocab_size"])
SMOKE_HEAD = (64, 512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_head(fn, tokens: int, dim: int, vocab: int, device: torch.device, repeats: int) -> dict:
    """One kernel at one size: ``{"ms": median fwd+bwd, "extra_gib": peak above the inputs (CUDA) or None}``."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen, device=device).requires_grad_(True)
    weight = (torch.randn(vocab, dim, generator=gen, device=device) * 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    labels[::7] = -100
    upstream = torch.randn(tokens, generator=gen, device=device)
    times = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats + 1):
        hidden.grad = weight.grad = None
        _sync(device)
        start = time.perf_counter()
        (fn(hidden, weight, labels) * upstream).sum().backward()
        _sync(device)
        times.append(time.perf_counter() - start)
    extra = None
    if device.type == "cuda":
        extra = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return {"ms": 1e3 * statistics.median(times[1:]), "extra_gib": extra}


def head_timing(device: torch.device, *, smoke: bool = False, tokens: tuple[int, ...] = (8192, 32768)) -> list[dict]:
    """Rows ``{"kernel", "tokens", "ms", "extra_gib"}`` (or ``"error"``) for ``tiled`` and, on CUDA with Liger
    installed, ``liger``; each row's ``ratio`` is its time over ``tiled``'s at the same size."""
    dim, vocab = SMOKE_HEAD if smoke else HEAD_4B
    sizes = (96,) if smoke else tokens
    kernels = [("tiled", label_logprobs)]
    if device.type == "cuda" and liger_available():
        kernels.append(("liger", liger_label_logprobs))
    rows = []
    for n in sizes:
        tiled_ms = None
        for name, fn in kernels:
            row: dict = {"kernel": name, "tokens": n, "dim": dim, "vocab": vocab}
            try:
                row.update(time_head(fn, n, dim, vocab, device, repeats=2 if smoke else 3))
            except torch.OutOfMemoryError as exc:
                row["error"] = f"OOM: {str(exc).splitlines()[0][:200]}"
            except Exception as exc:  # a kernel that fails is reported, the others still run
                row["error"] = repr(exc)[:300]
            if name == "tiled" and "ms" in row:
                tiled_ms = row["ms"]
            if "ms" in row and tiled_ms:
                row["ratio"] = row["ms"] / tiled_ms
            rows.append(row)
    return rows
