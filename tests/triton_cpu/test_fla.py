"""fla's GatedDeltaNet scan and conv (ringtune's ``fla`` registry entries) on CPU under Triton's interpreter.

Float32 kernels against ringtune's float64 references (the per-token recurrence, the torch conv), forward and
every gradient, dense and varlen rows with initial and final states; plus the check that having fla and Triton
importable changes no default on CPU. Skipped (with the reason) without the ``triton-cpu`` extra. float32 only:
the interpreter does not round bfloat16 as a GPU does. Tolerances: float32 kernels summing over at most 64-token
chunks of unit-scale terms against a float64 oracle (measured 3.4e-5 for the scan, 6e-6 for the conv).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from support.triton_interpreter import interpreted_kernels, interpreter_session, missing_reason

from ringtune.ops.gated_delta.chunked import chunk_gated_delta_rule, default_chunk_scan
from ringtune.ops.gated_delta.conv import causal_conv1d, select_conv
from ringtune.ops.gated_delta.naive import naive_gated_delta_rule

pytestmark = pytest.mark.usefixtures("one_thread")
SCAN_LIMIT = 1e-4
CONV_LIMIT = 2e-5


@pytest.fixture(scope="module")
def fla_interpreted():
    reason = missing_reason("fla")
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        stack.enter_context(interpreter_session())
        interpreted_kernels("fla.ops.gated_delta_rule", "fla.modules.causal_conv1d")
        yield


def _scan_inputs(lens: list[int], heads: int = 2, dim: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float64 leaves of one packed row: q, k, v [T, H, D], g, beta [T, H], initial_state [n, H, D, D]."""
    gen = torch.Generator().manual_seed(seed)
    T, n = sum(lens), len(lens)
    x = {
        "q": torch.randn(T, heads, dim, generator=gen, dtype=torch.float64),
        "k": torch.nn.functional.normalize(torch.randn(T, heads, dim, generator=gen, dtype=torch.float64), dim=-1),
        "v": torch.randn(T, heads, dim, generator=gen, dtype=torch.float64),
        "g": -0.2 * torch.rand(T, heads, generator=gen, dtype=torch.float64),
        "beta": torch.rand(T, heads, generator=gen, dtype=torch.float64),
        "initial_state": 0.1 * torch.randn(n, heads, dim, dim, generator=gen, dtype=torch.float64),
    }
    return {k: v.requires_grad_(True) for k, v in x.items()}


def _run_scan(fn, x: dict[str, torch.Tensor], cu: torch.Tensor, dtype: torch.dtype, **kw):
    """Output, final state and every input's gradient (float64) of a fixed linear read-out of both."""
    leaves = {k: v.detach().to(dtype).requires_grad_(True) for k, v in x.items()}
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    o, final = fn(q, k, v, cu, g=leaves["g"], beta=leaves["beta"], initial_state=leaves["initial_state"], **kw)
    gen = torch.Generator().manual_seed(7)
    w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    w_s = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    ((o.double() * w_o).sum() + (final.double() * w_s).sum()).backward()
    return o.double(), final.double(), {k: t.grad.double() for k, t in leaves.items()}


@pytest.mark.parametrize("lens", [[128], [37, 0, 64, 90]], ids=["dense", "varlen"])
def test_fla_scan_matches_float64_recurrence(fla_interpreted, lens):
    x = _scan_inputs(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ref = _run_scan(naive_gated_delta_rule, x, cu, torch.float64, scale=1.0)
    start = time.perf_counter()
    got = _run_scan(chunk_gated_delta_rule, x, cu, torch.float32, scale=1.0, chunk_size=64, scan="fla")
    seconds = time.perf_counter() - start
    errors = {"o": (got[0] - ref[0]).abs().max(), "final_state": (got[1] - ref[1]).abs().max()}
    errors |= {f"d{k}": (got[2][k] - ref[2][k]).abs().max() for k in ref[2]}
    print(
        f"fla scan {lens}: {seconds:.1f} s; max |Δ| vs float64: "
        + ", ".join(f"{k} {float(v):.1e}" for k, v in errors.items())
    )
    for name, err in errors.items():
        assert err < SCAN_LIMIT, f"{name}: {float(err):.2e}"


def test_fla_conv_matches_torch_conv_in_float64(fla_interpreted):
    lens = [5, 0, 40, 19]
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x64 = torch.randn(sum(lens), 48, generator=gen, dtype=torch.float64)
    w64 = torch.randn(48, 4, generator=gen, dtype=torch.float64) / 2
    read = torch.randn(sum(lens), 48, generator=gen, dtype=torch.float64)

    def run(kernel: str, dtype: torch.dtype):
        x, w = (t.detach().clone().to(dtype).requires_grad_(True) for t in (x64, w64))
        y = causal_conv1d(x, w, cu, kernel=kernel)
        (y.double() * read).sum().backward()
        return y.double(), x.grad.double(), w.grad.double()

    ref, got = run("torch", torch.float64), run("fla", torch.float32)
    errors = {name: float((a - b).abs().max()) for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True)}
    print("fla conv: max |Δ| vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    for name, err in errors.items():
        assert err < CONV_LIMIT * (10 if name == "dw" else 1), f"{name}: {err:.2e}"  # dw sums ~64 terms per entry


def test_cpu_defaults_ignore_installed_kernels(fla_interpreted):
    """With fla and Triton importable and the interpreter on, a CPU caller still gets ringtune's own kernels."""
    cpu = torch.device("cpu")
    assert default_chunk_scan(cpu) == "recompute"
    assert select_conv(cpu, with_context=False) == "torch"
