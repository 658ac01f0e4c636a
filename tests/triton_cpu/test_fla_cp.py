"""fla's context parallelism (``fla.ops.cp``, the ``fla_cp`` CP mode) against ringtune's chunkwise hand-off at CP=2.

Two gloo ranks under Triton's interpreter (float32 fla kernels on CPU tensors). Each row of the hard-case catalogue
(sequences of 1-13 tokens, lengths not divisible by 2C, several sequences per row, a sequence longer than fla's
64-token chunk crossing the part boundary, a sequence that starts 2 tokens before the boundary so the conv halo is
cut, a pad-only row) runs the GDN core (conv, q/k L2 norm, gated delta rule) three ways: the float64 single-process
reference (ringtune's ``recompute`` scan), ringtune's ``chunkwise`` mode in float32 (summary all-gather + state
hand-off, ringtune's kernels) and ``fla_cp`` in float32 (fla's conv halo and affine state chain). Output, every
per-token gradient on each rank's shard and the conv weight's gradient summed over the group are compared pairwise;
bytes each rank sends and the seconds of forward + backward are printed (under the interpreter the time is NumPy's,
not a GPU's). Skipped (with the reason) without the ``triton-cpu`` extra.

Tolerance: float32 kernels against float64 over rows of at most ~160 tokens of unit-scale inputs, relative to the
largest reference element of each tensor (the float32 ``chunkwise`` run is the yardstick of float32 rounding; both
are printed). fla_cp against chunkwise is the same float32 rounding twice.
"""

from __future__ import annotations

import torch

HK, HV, DK, DV, KERNEL = 1, 2, 16, 16, 4
"""fla's ``tl.dot`` needs head dims of 16 or more; Hv = 2·Hk exercises grouped value heads."""
ROWS: dict[str, tuple[tuple[int, ...], int]] = {
    "short_near_boundary": ((13, 1, 1, 1, 5, 7), 1),
    "long_crossing": ((3, 150), 8),
    "pad_only": ((), 8),
}
"""Row -> (sequence lengths, stream pad multiple). ``short_near_boundary`` (pad multiple 1): six sequences of 1-13
tokens, lengths not divisible by 2C, the 7 crossing the part boundary 2 tokens after its start (the conv halo is cut
by a sequence start); ``long_crossing``: a sequence of 150 tokens, two of fla's 64-token chunks on each rank, its
state handed across; ``pad_only``: no sequence, the stream pad alone."""
MODES = ("chunkwise", "fla_cp")
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
LIMIT = 5e-6
"""Max error relative to max(|reference|, 1), float32 against float64 (measured up to 9e-7 over two runs; the float32
chunkwise yardstick alike)."""


def _row_inputs(lens: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """Float64 raw core inputs of one packed row: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], conv weight."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    # Slow decay on one head so state crosses the part boundary with weight.
    decay = torch.tensor([0.02, 0.3], dtype=torch.float64)
    return {
        "q": rnd(T, HK, DK),
        "k": rnd(T, HK, DK),
        "v": rnd(T, HV, DV),
        "g": -decay * torch.rand(T, HV, generator=gen, dtype=torch.float64),
        "beta": torch.rand(T, HV, generator=gen, dtype=torch.float64),
        "conv_weight": 0.5 * rnd(2 * HK * DK + HV * DV, KERNEL),
    }


def _relative_errors(got: dict, want: dict, scale: dict) -> dict[str, float]:
    """Per tensor name: max |got - want| / scale (0 for an empty tensor)."""
    return {n: float((got[n] - want[n]).abs().max()) / scale[n] if got[n].numel() else 0.0 for n in got}


def fla_cp_case(ctx) -> dict:
    """On each of two ranks: every row through the reference, chunkwise and fla_cp; errors, bytes and seconds."""
    import contextlib
    import time

    from support.triton_interpreter import fla_cp_on_cpu, interpreted_kernels, interpreter_session

    from ringtune.layout import zigzag_plan, zigzag_slice
    from ringtune.ops.gated_delta.core import gated_delta_core
    from ringtune.ops.gated_delta.cp import gdn_cp_fn
    from ringtune.ops.gated_delta.cp_chunkwise import _halo_mask
    from ringtune.parallel import measure_comm
    from ringtune.parallel.collectives import all_reduce_

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=1, cp=2)
    group = mesh.cp_group
    results = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(interpreter_session())
        interpreted_kernels("fla.ops.gated_delta_rule", "fla.modules.causal_conv1d", "fla.ops.cp")
        stack.enter_context(fla_cp_on_cpu())
        for index, (name, (lens, multiple)) in enumerate(ROWS.items()):
            x64 = {n: t.requires_grad_() for n, t in _row_inputs(lens, seed=index).items()}
            cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
            ref = gated_delta_core(
                *(x64[n] for n in ("q", "k", "v")), cu, g=x64["g"], beta=x64["beta"], conv_weight=x64["conv_weight"]
            )
            dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(50 + index), dtype=torch.float64)
            if lens:
                (ref * dout).sum().backward()
            want = {
                "out": ref.detach(),
                **{n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in x64.items()},
            }
            plan = zigzag_plan(
                lens, cp_size=2, cp_rank=mesh.cp_rank, pad_multiplier=multiple, pad_to=None if lens else 8
            )
            real = plan.is_real
            runs = {}
            for mode in MODES:
                local = {
                    n: (t.detach() if n == "conv_weight" else zigzag_slice(t.detach(), plan)).float()
                    for n, t in x64.items()
                }
                local = {n: t.requires_grad_() for n, t in local.items()}
                start = time.perf_counter()
                with measure_comm() as fwd:
                    out = gdn_cp_fn(mode)(*(local[n] for n in (*TOKEN_INPUTS, "conv_weight")), plan, group)
                with measure_comm() as bwd:
                    (out.double() * zigzag_slice(dout, plan)).sum().backward()
                seconds = time.perf_counter() - start
                got = {"out": out.detach().double()[real]}
                got |= {n: local[n].grad.double()[real] for n in TOKEN_INPUTS}
                got["conv_weight"] = all_reduce_(local["conv_weight"].grad.double(), group)
                runs[mode] = {
                    "got": got,
                    "bytes": (fwd.bytes_sent, bwd.bytes_sent),
                    "seconds": seconds,
                    "finite": bool(torch.isfinite(out).all()),
                }
            ref_local = {"out": zigzag_slice(want["out"], plan)[real], "conv_weight": want["conv_weight"]}
            ref_local |= {n: zigzag_slice(want[n], plan)[real] for n in TOKEN_INPUTS}
            # Relative to the largest reference element, absolute below 1 (a one-token sequence's dg is exactly 0).
            scale = {n: max(float(t.abs().max()) if t.numel() else 0.0, 1.0) for n, t in ref_local.items()}

            results[name] = {
                "chunkwise vs float64": _relative_errors(runs["chunkwise"]["got"], ref_local, scale),
                "fla_cp vs float64": _relative_errors(runs["fla_cp"]["got"], ref_local, scale),
                "fla_cp vs chunkwise": _relative_errors(runs["fla_cp"]["got"], runs["chunkwise"]["got"], scale),
                "bytes": {m: runs[m]["bytes"] for m in MODES},
                "seconds": {m: runs[m]["seconds"] for m in MODES},
                "finite": all(runs[m]["finite"] for m in MODES),
                "partial_halo": bool(0 < int(_halo_mask(plan, KERNEL - 1).sum()) < KERNEL - 1),
            }
    return results


def test_fla_cp_equals_chunkwise_and_float64_at_cp2(interpreted_pool2):
    per_rank = interpreted_pool2.run(fla_cp_case)
    worst: dict[str, float] = {}
    for rank, rows in enumerate(per_rank):
        for name, row in rows.items():
            assert row["finite"], (rank, name)
            for pair in ("chunkwise vs float64", "fla_cp vs float64", "fla_cp vs chunkwise"):
                for tensor, err in row[pair].items():
                    worst[pair] = max(worst.get(pair, 0.0), err)
                    assert err < LIMIT, (rank, name, pair, tensor, err)
            fwd_c, bwd_c = row["bytes"]["chunkwise"]
            fwd_f, bwd_f = row["bytes"]["fla_cp"]
            # At CP=2 fla's all-gathers carry exactly what ringtune's ring shift and summary all-gather carry.
            assert (fwd_f, bwd_f) == (fwd_c, bwd_c), (rank, name, row["bytes"])
    assert any(row["partial_halo"] for rows in per_rank for row in rows.values())  # the cut halo is exercised
    for pair, err in worst.items():
        print(f"{pair}: max relative |Δ| over rows, tensors and ranks {err:.1e}")
    for name, row in per_rank[0].items():
        b, s = row["bytes"], row["seconds"]
        print(
            f"{name}: rank-0 bytes fwd/bwd chunkwise {b['chunkwise'][0]}/{b['chunkwise'][1]}, fla_cp {b['fla_cp'][0]}/"
            f"{b['fla_cp'][1]}; seconds chunkwise {s['chunkwise']:.2f}, fla_cp {s['fla_cp']:.2f} (interpreted)"
        )
