"""Liger's fused linear cross-entropy (ringtune's ``liger`` head entry) on CPU under Triton's interpreter.

Float32 log-probs and gradients against the float64 reference head, with ignored positions; plus the check that
having Liger and Triton importable changes no default on CPU. Skipped (with the reason) without the
``triton-cpu`` extra. Tolerance: float32 softmax over a 512-entry vocabulary of unit-scale logits against float64
(measured 1.5e-5 on the loss).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from support.triton_interpreter import interpreted_kernels, interpreter_session, missing_reason

from ringtune.models.head_kernels import liger_label_logprobs, select_head
from ringtune.models.logprob_head import IGNORE_INDEX, reference_label_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 5e-5


@pytest.fixture(scope="module")
def liger_interpreted():
    reason = missing_reason("liger_kernel")
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        stack.enter_context(interpreter_session())
        interpreted_kernels("liger_kernel.ops.fused_linear_cross_entropy")
        yield


def test_liger_head_matches_float64_reference(liger_interpreted):
    T, D, V = 48, 32, 512
    gen = torch.Generator().manual_seed(0)
    hidden64 = torch.randn(T, D, generator=gen, dtype=torch.float64)
    weight64 = torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[::7] = IGNORE_INDEX
    read = torch.randn(T, generator=gen, dtype=torch.float64)

    def run(fn, dtype: torch.dtype):
        h, w = (t.clone().to(dtype).requires_grad_(True) for t in (hidden64, weight64))
        lp = fn(h, w, labels)
        (lp.double() * read).sum().backward()
        return lp.double(), h.grad.double(), w.grad.double()

    ref = run(reference_label_logprobs, torch.float64)
    start = time.perf_counter()
    got = run(liger_label_logprobs, torch.float32)
    seconds = time.perf_counter() - start
    errors = {name: float((a - b).abs().max()) for name, a, b in zip(("logprob", "dh", "dw"), got, ref, strict=True)}
    print(f"liger head: {seconds:.1f} s; max |Δ| vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert bool((got[0][labels == IGNORE_INDEX] == 0).all())
    for name, err in errors.items():
        assert err < LIMIT, f"{name}: {err:.2e}"


def test_cpu_default_head_ignores_installed_liger(liger_interpreted):
    labels = torch.zeros(4, dtype=torch.int64)
    assert select_head(torch.device("cpu"), labels).__name__ == "label_logprobs"
    assert select_head(torch.device("cpu"), labels, name="liger") is liger_label_logprobs  # explicit: allowed here
