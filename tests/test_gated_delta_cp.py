"""GatedDeltaNet CP (headwise, chunkwise) against the single-process core, float64, CP 1/2/4.

The CP modes run the default chunked scan (``recompute``: inputs and segment states kept, recomputed in the
backward); the float64 reference runs the ``autograd`` scan, so the comparison covers both.

Inputs are built from parameters (conv weight, A_log, dt_bias) and raw projections (q, k, v, a, b)
so every gradient the layer needs is checked: per-token ones on each rank's shard, parameter ones as
the SUM over the CP group (the replicated-parameter rule).
"""

from __future__ import annotations

import pytest
import torch

from ringtune.debug_faults import fault_hooks
from ringtune.errors import ParallelConfigError
from ringtune.layout import zigzag_plan, zigzag_slice
from ringtune.ops.gated_delta import gdn_gates
from ringtune.ops.gated_delta.core import gated_delta_core
from ringtune.ops.gated_delta.cp import gdn_cp_fn
from ringtune.ops.gated_delta.cp_chunkwise import _halo_mask
from ringtune.probes.scenarios import SCENARIOS

HK, HV, DK, DV, K = 4, 8, 8, 8, 4
ROWS = {
    **{name: lens for name, lens in SCENARIOS.items()},
    "short_then_long": (1, 1, 1, 2, 3, 120),
    # Sequences that start 1-2 tokens before a part boundary (a conv halo cut by a sequence start) at
    # CP 2 and 4. Sequence starts and part starts are both multiples of 2C when the stream pad multiple
    # is a multiple of 2C, so these rows use pad multiple 1 (TP=1 may), see STREAM_PAD_MULTIPLE.
    "near_boundary": (1, 1, 1, 5, 7),
    "straddle_mix": (30, 13, 30, 7, 30, 5, 5, 41),
}
STREAM_PAD_MULTIPLE = {"near_boundary": 1, "straddle_mix": 1}
"""Stream pad multiple per row (default 8)."""
TOKEN_INPUTS = ("q", "k", "v", "a", "b")
PARAMS = ("conv_weight", "A_log", "dt_bias")


def make_inputs(seq_lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * s

    tokens = {"q": rnd(T, HK, DK), "k": rnd(T, HK, DK), "v": rnd(T, HV, DV), "a": rnd(T, HV), "b": rnd(T, HV)}
    # Half the heads decay slowly (A_log small) so state crosses long spans and part boundaries.
    A_log = torch.cat([torch.full((HV // 2,), -4.0), rnd(HV // 2, s=0.5)]).double()
    params = {"conv_weight": rnd(2 * HK * DK + HV * DV, K, s=0.5), "A_log": A_log, "dt_bias": rnd(HV, s=0.5)}
    return tokens, params


def max_abs(x: torch.Tensor) -> float:
    return float(x.detach().abs().max()) if x.numel() else 0.0


def core_inputs(tokens, params):
    """(q, k, v, g, beta, conv_weight) of the GDN core, the gates computed from a, b, A_log, dt_bias."""
    g, beta = gdn_gates(tokens["a"], tokens["b"], params["A_log"], params["dt_bias"])
    return tokens["q"], tokens["k"], tokens["v"], g.to(torch.float64), beta, params["conv_weight"]


def gdn_case(ctx, *, mode: str, cp: int, fault: str | None = None, rows=None):
    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    fn = gdn_cp_fn(mode)
    results = {}
    for index, (name, seq_lens) in enumerate((rows or ROWS).items()):
        tokens, params = make_inputs(seq_lens, 100 * index + mesh.dp_rank)
        cu = torch.tensor([0, *torch.tensor(seq_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
        ref_t = {n: t.clone().requires_grad_() for n, t in tokens.items()}
        ref_p = {n: p.clone().requires_grad_() for n, p in params.items()}
        q, k, v, g, beta, w = core_inputs(ref_t, ref_p)
        # The reference runs the scan autograd keeps whole; the CP modes run the default (recomputing) scan.
        ref_o = gated_delta_core(q, k, v, cu, g=g, beta=beta, conv_weight=w, scan="autograd")
        dout = torch.randn(ref_o.shape, generator=torch.Generator().manual_seed(index), dtype=torch.float64)
        if seq_lens:
            (ref_o * dout).sum().backward()
        # A pad-only microbatch still holds the per-rank budget's worth of pad tokens.
        pad_to = None if seq_lens else 8
        multiple = STREAM_PAD_MULTIPLE.get(name, 8)
        plan = zigzag_plan(seq_lens, cp_size=cp, cp_rank=mesh.cp_rank, pad_multiplier=multiple, pad_to=pad_to)
        loc_t = {n: zigzag_slice(t, plan).requires_grad_() for n, t in tokens.items()}
        loc_p = {n: p.clone().requires_grad_() for n, p in params.items()}
        faults = fault_hooks(fault, cp_size=cp, cp_rank=mesh.cp_rank, plan=plan)
        out = fn(*core_inputs(loc_t, loc_p), plan, mesh.cp_group, faults=faults)
        (out * zigzag_slice(dout, plan)).sum().backward()

        real = plan.is_real
        row = {"out": max_abs(out[real] - zigzag_slice(ref_o.detach(), plan)[real])}
        for n in TOKEN_INPUTS:
            want = zigzag_slice(ref_t[n].grad if ref_t[n].grad is not None else torch.zeros_like(tokens[n]), plan)
            row[n] = max_abs(loc_t[n].grad[real] - want[real])
        row["finite"] = bool(torch.isfinite(out).all())
        row["params"] = {n: loc_p[n].grad.clone() for n in PARAMS}
        row["ref_params"] = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in ref_p.items()}
        row["partial_halo"] = bool(0 < int(_halo_mask(plan, K - 1).sum()) < K - 1)
        results[name] = row
    return results


def check(per_rank, cp: int, tol: float) -> None:
    for name in per_rank[0]:
        for rank, res in enumerate(per_rank):
            row = res[name]
            assert row["finite"], (rank, name)
            bad = {n: row[n] for n in ("out", *TOKEN_INPUTS) if not row[n] <= tol}
            assert not bad, f"rank {rank} row {name}: {bad}"
        for group_start in range(0, len(per_rank), cp):
            group = per_rank[group_start : group_start + cp]
            for n in PARAMS:
                summed = sum(res[name]["params"][n] for res in group)
                err = float((summed - group[0][name]["ref_params"][n]).abs().max())
                assert err <= tol, f"param {n} row {name}: {err}"


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["headwise", "chunkwise"])
def test_float64_equals_single_process(pool4, mode, cp):
    per_rank = pool4.run(gdn_case, mode=mode, cp=cp)
    check(per_rank, cp, tol=1e-10)
    if mode == "chunkwise" and cp > 1:  # the rows do exercise a conv halo cut by a sequence start
        assert any(row["partial_halo"] for res in per_rank for row in res.values())


@pytest.mark.parametrize("fault", ["gdn_state_dropped", "gdn_halo_dropped"])
def test_negative_control_chunkwise_without_handoff_fails(pool4, fault):
    rows = {"long_mixed": SCENARIOS["long_mixed"]}
    per_rank = pool4.run(gdn_case, mode="chunkwise", cp=4, fault=fault, rows=rows)
    assert max(res["long_mixed"]["out"] for res in per_rank) > 1e-3


def test_fla_cp_is_named_but_refused_without_cuda(monkeypatch):
    """``fla_cp`` is a registry name the CLI accepts, never a default; a host without CUDA (and, under Triton's
    interpreter, without fla installed: this process never has it) refuses it naming the flag and the way out."""
    from ringtune.cli import build_parser
    from ringtune.ops.cp_modes import ALL_GATED_DELTA_MODES, GATED_DELTA_MODES
    from ringtune.ops.gated_delta.cp_fla import fla_cp_gated_delta
    from ringtune.ops.gated_delta.fla_kernels import FlaUnavailableError

    assert "fla_cp" in ALL_GATED_DELTA_MODES and "fla_cp" not in GATED_DELTA_MODES
    assert build_parser().parse_args(["serve", "--linear-cp-mode", "fla_cp"]).linear_cp_mode == "fla_cp"
    with pytest.raises(ParallelConfigError, match=r"\(--linear-cp-mode fla_cp\) cannot run here: .* no CUDA device; "):
        gdn_cp_fn("fla_cp")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ParallelConfigError, match="flash-linear-attention and triton are not installed"):
        gdn_cp_fn("fla_cp")
    x = torch.zeros(4, 1, 16)
    with pytest.raises(FlaUnavailableError, match="--linear-cp-mode fla_cp"):
        fla_cp_gated_delta(
            x, x, x, x[..., 0], x[..., 0], torch.zeros(48, 4), zigzag_plan((4,), cp_size=1, cp_rank=0), None
        )


def headwise_bad_heads_case(ctx):
    mesh = ctx.mesh(dp=1, cp=4)
    plan = zigzag_plan((9,), cp_size=4, cp_rank=mesh.cp_rank, pad_multiplier=8)
    T = plan.local_len
    q = torch.zeros(T, 2, 4)
    v = torch.zeros(T, 6, 4)
    try:
        gdn_cp_fn("headwise")(q, q, v, torch.zeros(T, 6), torch.zeros(T, 6), torch.zeros(40, 4), plan, mesh.cp_group)
    except ParallelConfigError as exc:
        return str(exc)
    return None


def test_headwise_rejects_heads_not_divisible(pool4):
    for message in pool4.run(headwise_bad_heads_case):
        assert message is not None and "linear key heads" in message and "2 % (1·4)" in message


# Low precision: CP and single process run the same dtype and differ only in summation order and in
# where intermediate values are rounded to the input dtype (the relayouts move bf16 values exactly; the
# chunkwise state summaries are float32). float32: ~1e-6 relative measured, limit 1e-4. bfloat16: the
# core's output is rounded to bf16 (2^-8 ~ 4e-3 relative) after float32 math on both sides, so outputs
# differ by a few bf16 ulps at most; gradients pass through more roundings: limit 3e-2 relative to the
# largest entry (a real layout bug, e.g. a dropped hand-off, gives O(1), see the negative control).
LOW_PRECISION = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """max |a - b| over max |scale| (the whole row's reference: a shard may hold only near-zero entries)."""
    if not a.numel():
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max()) / max(float(scale.abs().max()), 1e-30)


def gdn_low_precision_case(ctx, *, mode: str, cp: int, dtype: torch.dtype):
    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    fn = gdn_cp_fn(mode)
    results = {}
    for index, name in enumerate(("long_mixed", "near_boundary")):
        seq_lens = ROWS[name]
        tokens, params = make_inputs(seq_lens, 7 + index)
        tokens = {n: t.to(dtype) for n, t in tokens.items()}
        params = {n: p.to(dtype) for n, p in params.items()}
        cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int64)

        def inputs(tok, par):
            g, beta = gdn_gates(tok["a"], tok["b"], par["A_log"], par["dt_bias"])  # g float32 for bf16
            return tok["q"], tok["k"], tok["v"], g, beta, par["conv_weight"]

        ref_t = {n: t.clone().requires_grad_() for n, t in tokens.items()}
        ref_p = {n: p.clone().requires_grad_() for n, p in params.items()}
        q, k, v, g, beta, w = inputs(ref_t, ref_p)
        ref_o = gated_delta_core(q, k, v, cu, g=g, beta=beta, conv_weight=w)
        dout = torch.randn(ref_o.shape, generator=torch.Generator().manual_seed(index)).to(dtype)
        (ref_o.float() * dout.float()).sum().backward()
        plan = zigzag_plan(seq_lens, cp_size=cp, cp_rank=mesh.cp_rank, pad_multiplier=STREAM_PAD_MULTIPLE.get(name, 8))
        loc_t = {n: zigzag_slice(t, plan).requires_grad_() for n, t in tokens.items()}
        loc_p = {n: p.clone().requires_grad_() for n, p in params.items()}
        out = fn(*inputs(loc_t, loc_p), plan, mesh.cp_group)
        (out.float() * zigzag_slice(dout, plan).float()).sum().backward()
        real = plan.is_real
        want_o = ref_o.detach()
        row = {"dtype": str(out.dtype), "out": rel_err(out[real], zigzag_slice(want_o, plan)[real], want_o)}
        for n in ("q", "k", "v", "a"):
            want = ref_t[n].grad
            row[n] = rel_err(loc_t[n].grad[real], zigzag_slice(want, plan)[real], want)
        grad_w = loc_p["conv_weight"].grad.double()
        torch.distributed.all_reduce(grad_w, group=mesh.cp_group)
        row["conv_weight"] = rel_err(grad_w, ref_p["conv_weight"].grad, ref_p["conv_weight"].grad)
        results[name] = row
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["headwise", "chunkwise"])
def test_low_precision_close_to_single_process(pool4, mode, dtype):
    for cp in (2, 4):
        for rank, res in enumerate(pool4.run(gdn_low_precision_case, mode=mode, cp=cp, dtype=dtype)):
            for name, row in res.items():
                assert row.pop("dtype") == str(dtype), (rank, name)  # outputs keep the input dtype
                bad = {n: e for n, e in row.items() if not e <= LOW_PRECISION[dtype]}
                assert not bad, (cp, rank, name, bad)
