"""ringtune.ops.gated_delta.recurrent and .prefill: one-token GDN decoding against the packed references.

Stepping every sequence of a packed row token by token (the conv step from its window, the rule step from its
state, a batch of sequences of different lengths at once) must reproduce the naive per-token rule and the
reference conv over the whole row, and the prefill's final states and windows must be what the steps continue
from. float64: 1e-12 (the same arithmetic in another order).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ringtune.ops.gated_delta import gdn_gates, naive_causal_conv1d, naive_gated_delta_rule
from ringtune.ops.gated_delta.core import gated_delta_core, pack_qkv, unpack_qkv
from ringtune.ops.gated_delta.prefill import gated_delta_prefill, last_inputs
from ringtune.ops.gated_delta.recurrent import causal_conv1d_step, gated_delta_decode_core, gated_delta_step
from tests.sample_fixtures import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
LENS = (1, 3, 7, 70)  # one token, shorter than the conv window, and longer than a 64-token chunk


def cu_of(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)


def inputs(lens, *, Hk=2, Hv=4, Dk=8, Dv=6, K=4, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    g, beta = gdn_gates(rand(T, Hv), rand(T, Hv), torch.full((Hv,), -1.0, dtype=F64), torch.zeros(Hv, dtype=F64))
    x = {"q": rand(T, Hk, Dk), "k": rand(T, Hk, Dk), "v": rand(T, Hv, Dv), "g": g, "beta": beta}
    x = {n: t.to(dtype) for n, t in x.items()}
    x["g"] = g.to(torch.float32 if dtype != F64 else F64)
    return x, rand(2 * Hk * Dk + Hv * Dv, K).to(dtype) * 0.5


def step_through(lens, x, conv_weight, start_window, start_state, *, core: bool):
    """Decode every sequence token by token, all sequences in one batch (finished ones drop out)."""
    bounds = list(itertools.pairwise(cu_of(lens).tolist()))
    window, state = start_window.clone(), start_state.clone()
    out = torch.full((sum(lens), x["v"].shape[1], x["v"].shape[2]), float("nan"), dtype=x["v"].dtype)
    for t in range(max(lens)):
        rows = [i for i, (s, e) in enumerate(bounds) if s + t < e]
        tok = torch.tensor([bounds[i][0] + t for i in rows])
        q, k, v, g, beta = (x[n][tok] for n in ("q", "k", "v", "g", "beta"))
        if core:
            o, window[rows], state[rows] = gated_delta_decode_core(
                q, k, v, g=g, beta=beta, conv_weight=conv_weight, conv_window=window[rows], state=state[rows]
            )
        else:
            o, state[rows] = gated_delta_step(q, k, v, g=g, beta=beta, state=state[rows], use_qk_l2norm=True)
        out[tok] = o
    return out, window, state


def test_rule_step_equals_naive():
    x, _ = inputs(LENS)
    n, (Hv, Dv), Dk = len(LENS), x["v"].shape[1:], x["k"].shape[2]
    init = torch.randn(n, Hv, Dk, Dv, dtype=F64, generator=torch.Generator().manual_seed(1))
    want_o, want_s = naive_gated_delta_rule(
        x["q"], x["k"], x["v"], cu_of(LENS), g=x["g"], beta=x["beta"], initial_state=init, use_qk_l2norm=True
    )
    window = torch.zeros(n, 3, 1, dtype=F64)
    got_o, _, got_s = step_through(LENS, x, None, window, init, core=False)
    assert (got_o - want_o).abs().max() < 1e-12
    assert (got_s - want_s).abs().max() < 1e-12


def test_conv_step_equals_reference_conv():
    gen = torch.Generator().manual_seed(2)
    T, D, K = sum(LENS), 5, 4
    x, w = torch.randn(T, D, generator=gen, dtype=F64), torch.randn(D, K, generator=gen, dtype=F64)
    ctx = torch.randn(len(LENS), K - 1, D, generator=gen, dtype=F64)
    want = naive_causal_conv1d(x, w, cu_of(LENS), initial_context=ctx)
    for i, (s, e) in enumerate(itertools.pairwise(cu_of(LENS).tolist())):
        window = ctx[i : i + 1]
        for t in range(s, e):
            out, window = causal_conv1d_step(x[t : t + 1], window, w)
            assert (out[0] - want[t]).abs().max() < 1e-12
        # the final window is the last K-1 inputs of [context ++ sequence]
        assert torch.equal(window[0], torch.cat([ctx[i], x[s:e]])[-(K - 1) :])


def test_prefill_states_continue_decoding():
    """Prefill on a prefix of each sequence, then step the rest: equals the core over whole sequences."""
    x, w = inputs(LENS)
    cu = cu_of(LENS)
    want = gated_delta_core(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], conv_weight=w)
    prefix = tuple(max(1, n // 2) for n in LENS)
    rest = tuple(n - p for n, p in zip(LENS, prefix, strict=True))
    bounds = list(itertools.pairwise(cu.tolist()))
    head = torch.cat([torch.arange(s, s + p) for (s, _), p in zip(bounds, prefix, strict=True)])
    tail = torch.cat([torch.arange(s + p, e) for (s, e), p in zip(bounds, prefix, strict=True)])
    xh = {n: t[head] for n, t in x.items()}
    o, final, window = gated_delta_prefill(
        xh["q"], xh["k"], xh["v"], cu_of(prefix), g=xh["g"], beta=xh["beta"], conv_weight=w
    )
    assert torch.equal(o, gated_delta_core(xh["q"], xh["k"], xh["v"], cu_of(prefix), g=xh["g"], beta=xh["beta"],
                                           conv_weight=w))  # fmt: skip
    assert (o - want[head]).abs().max() < 1e-12
    xt = {n: t[tail] for n, t in x.items()}
    got, _, _ = step_through(rest, xt, w, window, final, core=True)
    assert (got - want[tail]).abs().max() < 1e-12


def test_last_inputs_pads_short_sequences():
    x = torch.arange(1, 11, dtype=F64)[:, None]
    got = last_inputs(x, cu_of((1, 2, 0, 7)), 3)
    assert got[:, :, 0].tolist() == [[0, 0, 1], [0, 2, 3], [0, 0, 0], [8, 9, 10]]


def test_float32_step_keeps_dtypes():
    """float32 inputs: output in float32, state float32; agrees with the float64 naive rule to float32 rounding."""
    x, w = inputs((9,), dtype=torch.float32)
    state = torch.zeros(1, 4, 8, 6)
    o, window, s = gated_delta_decode_core(
        x["q"][:1], x["k"][:1], x["v"][:1], g=x["g"][:1], beta=x["beta"][:1], conv_weight=w,
        conv_window=torch.zeros(1, 3, w.shape[0]), state=state,
    )  # fmt: skip
    assert o.dtype == torch.float32 and s.dtype == torch.float32 and window.dtype == torch.float32
    mixed = F.silu(pack_qkv(x["q"][:1], x["k"][:1], x["v"][:1]).double() * w[:, -1].double())
    q, k, v = unpack_qkv(mixed, 2, 8, 4, 6)
    want, _ = naive_gated_delta_rule(
        q, k, v, cu_of((1,)), g=x["g"][:1].double(), beta=x["beta"][:1].double(), use_qk_l2norm=True
    )
    assert (o.double() - want).abs().max() < 1e-5  # O(1) values, a few float32 roundings


def test_shape_errors():
    q = torch.zeros(2, 2, 4)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_step(q, q, torch.zeros(2, 4, 3), g=torch.zeros(2, 4), beta=torch.zeros(2, 4), state=torch.zeros(1))
    with pytest.raises(ValueError, match="window must have shape"):
        causal_conv1d_step(torch.zeros(2, 5), torch.zeros(2, 2, 5), torch.zeros(5, 4))
