"""ringtune.ops.gated_delta: the chunked kernel, conv, norms and affine summary against their references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ringtune.ops.gated_delta import (
    apply_affine_summary,
    causal_conv1d,
    chunk_gated_delta_rule,
    compose_affine_summaries,
    conv_taps,
    gated_delta_affine_summary,
    gated_rms_norm,
    gdn_gates,
    l2norm,
    naive_causal_conv1d,
    naive_gated_delta_rule,
)

F64 = torch.float64
MIXED = (1, 3, 63, 64, 65, 130)  # one token, short, around one chunk of 64, and more than two chunks


def cu_of(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)


def make_inputs(
    lens, *, H=2, Hk=None, Dk=16, Dv=12, dtype=F64, seed=0, normalise_k=True, initial=True, long_memory=False
):
    """Random leaves q, k, v, g, beta (and initial_state) of realistic range; k unit-norm unless told.

    ``long_memory``: weak decay and small beta, so that the incoming state still matters after 200 tokens
    (``|M| ~ 0.1`` instead of ``1e-5``) and the tests of the state's path are not vacuous.
    """
    gen = torch.Generator().manual_seed(seed)
    T, n, Hk = sum(lens), len(lens), Hk or H

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    k = rand(T, Hk, Dk)
    if normalise_k:  # an unnormalised k with |k|² ≫ 1 makes (I − βkkᵀ) expanding and the state blow up
        k = F.normalize(k, dim=-1)
    low, high, shift = (1e-3, 1e-2, -2.0) if long_memory else (1e-2, 0.2, 0.0)
    A_log = torch.empty(H, dtype=F64).uniform_(math.log(low), math.log(high), generator=gen)
    g, beta = gdn_gates(rand(T, H), rand(T, H) + shift, A_log, torch.zeros(H, dtype=F64))  # g in (−0.3, 0) mostly
    x = {"q": rand(T, Hk, Dk), "k": k, "v": rand(T, H, Dv), "g": g, "beta": beta}
    if initial:
        x["initial_state"] = rand(n, H, Dk, Dv) * 0.5
    return {name: t.to(dtype).requires_grad_() for name, t in x.items()}


def run(fn, x, cu, **kw):
    """(o, final_state, {name: grad}) of ``fn`` with fixed random cotangents of o and final_state."""
    o, state = fn(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], initial_state=x.get("initial_state"), **kw)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    ds = torch.randn(state.shape, generator=gen, dtype=F64)
    loss = (o.to(F64) * do).sum() + (state.to(F64) * ds).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    return o, state, dict(zip(x, grads, strict=True))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.to(F64) - b.to(F64)).abs().max().item()


# --- chunked vs naive ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("initial", "l2", "chunk_size"),
    [(False, False, 64), (True, False, 64), (True, True, 64), (True, False, 16)],
    ids=["zero_state", "initial_state", "initial_state_l2norm", "chunk16"],
)
def test_chunked_matches_naive_float64(initial, l2, chunk_size):
    x = make_inputs(MIXED, initial=initial, normalise_k=not l2, long_memory=initial)
    cu = cu_of(MIXED)
    o_ref, s_ref, g_ref = run(naive_gated_delta_rule, x, cu, use_qk_l2norm=l2)
    o, s, grads = run(chunk_gated_delta_rule, x, cu, use_qk_l2norm=l2, chunk_size=chunk_size)
    assert o.dtype == F64 and s.dtype == F64 and s.shape == (len(MIXED), 2, 16, 12)
    assert max_err(o, o_ref) < 1e-10
    assert max_err(s, s_ref) < 1e-10
    for name, grad in grads.items():
        assert max_err(grad, g_ref[name]) < 1e-10, name


def test_grouped_value_heads_equal_repeated_keys():
    x = make_inputs(MIXED, H=4, Hk=2, seed=1)
    cu = cu_of(MIXED)
    o, s, grads = run(chunk_gated_delta_rule, x, cu)
    rep = {name: t.detach().clone() for name, t in x.items()}
    rep["q"], rep["k"] = (t.repeat_interleave(2, dim=1) for t in (rep["q"], rep["k"]))
    rep = {name: t.requires_grad_() for name, t in rep.items()}
    o_rep, s_rep, g_rep = run(chunk_gated_delta_rule, rep, cu)
    assert max_err(o, o_rep) < 1e-12 and max_err(s, s_rep) < 1e-12
    for name in ("q", "k"):  # the gradient of a shared key head is the sum over the value heads it serves
        assert max_err(grads[name], g_rep[name].view(*grads[name].shape[:1], 2, 2, -1).sum(2)) < 1e-12
    for name in ("v", "g", "beta", "initial_state"):
        assert max_err(grads[name], g_rep[name]) < 1e-12


# The fp64 reference gets the very same (rounded) inputs, so only the kernel's own arithmetic differs.
# float32: fp32 rounding (6e-8) of well-conditioned terms (|o|, |S| ≲ 3, |k| = 1, contractions) over
# ≤ 130 steps: measured 5e-7 (o), 2e-7 (state), 3e-7 of the largest gradient; 1e-5 leaves a 20× margin.
# bfloat16: the kernel computes in fp32 and rounds only at the end: o to bf16 (half an ulp is ≤ 2^-8·|o|,
# |o| < 4: ≤ 0.016, measured 0.007), and each leaf's gradient to bf16 (≤ 2^-8 = 0.0039 of the largest
# gradient, measured 0.0027); the state is returned in fp32, so it keeps the fp32 bound.
@pytest.mark.parametrize(
    ("dtype", "tol_o", "tol_state", "tol_grad"),
    [(torch.float32, 1e-5, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 1e-5, 5e-3)],
    ids=["float32", "bfloat16"],
)
def test_chunked_low_precision(dtype, tol_o, tol_state, tol_grad):
    x = make_inputs(MIXED, dtype=dtype, seed=2)
    x64 = {name: t.detach().to(F64).requires_grad_() for name, t in x.items()}
    cu = cu_of(MIXED)
    o, s, grads = run(chunk_gated_delta_rule, x, cu)
    o_ref, s_ref, g_ref = run(naive_gated_delta_rule, x64, cu)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert max_err(o, o_ref) < tol_o
    assert max_err(s, s_ref) < tol_state
    for name, grad in grads.items():
        scale = max(1.0, g_ref[name].abs().max().item())
        assert max_err(grad, g_ref[name]) / scale < tol_grad, name


def test_state_resets_at_document_boundaries():
    lens = (5, 70, 1, 40)
    x = make_inputs(lens, initial=False, seed=3)
    row, _ = chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu_of(lens), g=x["g"], beta=x["beta"])
    for (start, end), length in zip(itertools.pairwise(cu_of(lens).tolist()), lens, strict=True):
        alone, _ = chunk_gated_delta_rule(
            *(x[name][start:end] for name in ("q", "k", "v")),
            cu_of((length,)),
            g=x["g"][start:end],
            beta=x["beta"][start:end],
        )
        assert max_err(row[start:end], alone) < 1e-12
    no_state, none = chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], cu_of(lens), g=x["g"], beta=x["beta"], output_final_state=False
    )
    assert none is None and torch.equal(no_state, row)
    # Negative check: as one document the state carries over and the second document changes.
    merged, _ = chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu_of((sum(lens),)), g=x["g"], beta=x["beta"])
    assert max_err(merged[5:75], row[5:75]) > 1e-3


def test_empty_sequences_keep_their_state():
    lens = (3, 0, 65, 0)
    x = make_inputs(lens, seed=4)
    o, s, _ = run(chunk_gated_delta_rule, x, cu_of(lens))
    o_ref, s_ref, _ = run(naive_gated_delta_rule, x, cu_of(lens))
    assert max_err(o, o_ref) < 1e-10 and max_err(s, s_ref) < 1e-10
    assert torch.equal(s[1], x["initial_state"][1]) and torch.equal(s[3], x["initial_state"][3])
    empty = make_inputs((), seed=4)
    o, s = chunk_gated_delta_rule(empty["q"], empty["k"], empty["v"], cu_of(()), g=empty["g"], beta=empty["beta"])
    assert o.shape == (0, 2, 12) and s.shape == (0, 2, 16, 12)


def test_bad_shapes_name_the_argument():
    x = {name: t.detach() for name, t in make_inputs((4, 3), seed=5).items()}
    cu = cu_of((4, 3))
    cases = {
        "v must have shape": {"v": x["v"][:5]},
        "beta must have shape": {"beta": x["beta"][:, :1]},
        "initial_state must have shape": {"initial_state": x["initial_state"][:1]},
        "cu_seqlens must be an int64": {"cu": cu.int()},
        "cu_seqlens must start at 0 and end at T=7": {"cu": torch.tensor([0, 4, 6])},
        "q must have shape": {"q": x["q"][:, :, :3]},
    }
    for message, change in cases.items():
        y = {**x, **change}
        with pytest.raises(ValueError, match=message):
            chunk_gated_delta_rule(
                y["q"], y["k"], y["v"], y.get("cu", cu), g=y["g"], beta=y["beta"], initial_state=y["initial_state"]
            )


# --- affine summary -----------------------------------------------------------------------------


def test_affine_summary_identity():
    x = {name: t.detach() for name, t in make_inputs(MIXED, seed=6, long_memory=True).items()}
    cu = cu_of(MIXED)
    M, h_local = gated_delta_affine_summary(x["k"], x["v"], cu, g=x["g"], beta=x["beta"])
    assert M.shape == (len(MIXED), 2, 16, 16) and h_local.shape == (len(MIXED), 2, 16, 12) and M.dtype == F64
    h_in = x["initial_state"]
    _, final = chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], initial_state=h_in)
    assert max_err(final, apply_affine_summary(M, h_local, h_in)) < 1e-10
    _, from_zero = naive_gated_delta_rule(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"])
    assert max_err(h_local, from_zero) < 1e-10
    # M against its definition: the product P_L ··· P_1 of P_t = α_t (I − β_t k_t k_tᵀ), for the 65-token sequence.
    start, end = cu[4].item(), cu[5].item()
    P = torch.eye(16, dtype=F64).expand(2, 16, 16)
    for t in range(start, end):
        kt = x["k"][t].unsqueeze(-1)
        P = (x["g"][t].exp().view(2, 1, 1) * (torch.eye(16, dtype=F64) - x["beta"][t].view(2, 1, 1) * kt @ kt.mT)) @ P
    assert max_err(M[4], P) < 1e-12


def test_affine_summaries_compose_across_a_split():
    lens = (195,)
    x = {name: t.detach() for name, t in make_inputs(lens, seed=7, long_memory=True).items()}
    whole = gated_delta_affine_summary(x["k"], x["v"], cu_of(lens), g=x["g"], beta=x["beta"])
    for split in (1, 64, 100):  # as if two CP ranks each held one part of the sequence
        M, h = gated_delta_affine_summary(x["k"], x["v"], cu_of((split, 195 - split)), g=x["g"], beta=x["beta"])
        M12, h12 = compose_affine_summaries((M[:1], h[:1]), (M[1:], h[1:]))
        assert max_err(M12, whole[0]) < 1e-12 and max_err(h12, whole[1]) < 1e-12
    M, h = gated_delta_affine_summary(x["k"][:0], x["v"][:0], cu_of((0,)), g=x["g"][:0], beta=x["beta"][:0])
    assert torch.equal(M[0], torch.eye(16, dtype=F64).expand(2, 16, 16)) and not h.any()


# --- conv ---------------------------------------------------------------------------------------


def per_document_conv1d(x, weight, lens, bias, activation):
    """Each document alone through ``F.conv1d`` with K−1 zeros of left padding (transformers' fallback)."""
    outs = []
    for (start, end), _ in zip(itertools.pairwise(cu_of(lens).tolist()), lens, strict=True):
        seq = x[start:end].t().unsqueeze(0)
        out = F.conv1d(seq, weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=x.shape[1])
        outs.append(out[0, :, : end - start].t())
    out = torch.cat(outs)
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize(("K", "bias", "activation"), [(4, False, "silu"), (4, True, None), (2, True, "silu")])
def test_conv_matches_per_document_conv1d(K, bias, activation):
    gen = torch.Generator().manual_seed(8)
    lens, D = (1, 3, 4, 9, 2), 6
    x = torch.randn(sum(lens), D, generator=gen, dtype=F64)
    w = torch.randn(D, K, generator=gen, dtype=F64)
    b = torch.randn(D, generator=gen, dtype=F64) if bias else None
    expected = per_document_conv1d(x, w, lens, b, activation)
    for fn in (causal_conv1d, naive_causal_conv1d):
        assert max_err(fn(x, w, cu_of(lens), bias=b, activation=activation), expected) < 1e-13
    # Negative check: one conv over the packed row leaks the end of a document into the next.
    leaky = per_document_conv1d(x, w, (sum(lens),), b, activation)
    assert max_err(leaky, expected) > 1e-3


def test_conv_initial_context_is_a_halo():
    gen = torch.Generator().manual_seed(9)
    lens, D, K = (1, 2, 3, 8), 5, 4
    x = torch.randn(sum(lens), D, generator=gen, dtype=F64)
    w, b = torch.randn(D, K, generator=gen, dtype=F64), torch.randn(D, generator=gen, dtype=F64)
    ctx = torch.randn(len(lens), K - 1, D, generator=gen, dtype=F64)
    out = causal_conv1d(x, w, cu_of(lens), bias=b, initial_context=ctx)
    assert max_err(out, naive_causal_conv1d(x, w, cu_of(lens), bias=b, initial_context=ctx)) < 1e-13
    for i, (start, end) in enumerate(itertools.pairwise(cu_of(lens).tolist())):
        extended = torch.cat([ctx[i], x[start:end]])
        alone = causal_conv1d(extended, w, cu_of((K - 1 + end - start,)), bias=b)
        assert max_err(out[start:end], alone[K - 1 :]) < 1e-13


@pytest.mark.parametrize(
    ("K", "activation", "block_rows"), [(4, None, 512), (4, "silu", 3), (2, "silu", 512), (1, None, 2)]
)
def test_conv_gradients_float64(K, activation, block_rows, monkeypatch):
    """The taps conv's hand-written backward against autograd through the per-sequence reference: empty
    sequences, kernel widths 1-4, with and without SiLU, and row blocks smaller than the row (``BLOCK_ROWS``)."""
    monkeypatch.setattr(conv_taps, "BLOCK_ROWS", block_rows)
    gen = torch.Generator().manual_seed(10)
    lens, D = (1, 0, 5, 2, 0, 7), 3
    leaves = [
        torch.randn(sum(lens), D, generator=gen, dtype=F64),
        torch.randn(D, K, generator=gen, dtype=F64),
        torch.randn(D, generator=gen, dtype=F64),
        torch.randn(len(lens), K - 1, D, generator=gen, dtype=F64),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    cu = cu_of(lens)

    def fast(x, w, b, ctx):
        return causal_conv1d(x, w, cu, bias=b, initial_context=ctx, activation=activation)

    assert torch.autograd.gradcheck(fast, leaves)
    dout = torch.randn(sum(lens), D, generator=gen, dtype=F64)
    g_fast = torch.autograd.grad((fast(*leaves) * dout).sum(), leaves)
    naive = naive_causal_conv1d(*leaves[:2], cu, bias=leaves[2], initial_context=leaves[3], activation=activation)
    g_naive = torch.autograd.grad((naive * dout).sum(), leaves)
    for a, b in zip(g_fast, g_naive, strict=True):
        assert a.numel() == 0 or max_err(a, b) < 1e-13  # K = 1: no context


def test_conv_bad_shapes_name_the_argument():
    x, w, cu = torch.zeros(5, 3), torch.zeros(3, 4), cu_of((2, 3))
    with pytest.raises(ValueError, match="weight must have shape"):
        causal_conv1d(x, torch.zeros(4, 4), cu)
    with pytest.raises(ValueError, match="initial_context must have shape"):
        causal_conv1d(x, w, cu, initial_context=torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="bias must have shape"):
        causal_conv1d(x, w, cu, bias=torch.zeros(4))


# --- norms and gates ----------------------------------------------------------------------------


def test_l2norm_and_gated_rms_norm_float64():
    gen = torch.Generator().manual_seed(11)
    x, z = torch.randn(7, 2, 8, generator=gen, dtype=F64), torch.randn(7, 2, 8, generator=gen, dtype=F64)
    w = torch.randn(8, generator=gen, dtype=F64)
    assert max_err(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)) < 1e-15
    rms = torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert max_err(gated_rms_norm(x, z, w), x / rms * w * z * torch.sigmoid(z)) < 1e-14
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16


def test_gdn_gates():
    gen = torch.Generator().manual_seed(12)
    a, b = torch.randn(5, 3, generator=gen).bfloat16(), torch.randn(5, 3, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16 and (g <= 0).all()
    expected = -A_log.exp() * torch.log1p(torch.exp(a.float() + dt_bias))
    assert max_err(g, expected) < 1e-6 and max_err(beta, torch.sigmoid(b.float())) < 4e-3
    with pytest.raises(ValueError, match="A_log must have shape"):
        gdn_gates(a, b, A_log[:2], dt_bias)


# --- transformers' torch fallbacks, one document per batch row ------------------------------------


def test_matches_transformers_fallbacks():
    tq = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    lens = MIXED
    x = {name: t.detach() for name, t in make_inputs(lens, H=4, Hk=2, seed=13, normalise_k=False).items()}
    cu = cu_of(lens)
    o, s = chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], initial_state=x["initial_state"], use_qk_l2norm=True
    )
    o_naive, _ = naive_gated_delta_rule(
        x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], initial_state=x["initial_state"], use_qk_l2norm=True
    )
    assert max_err(o, o_naive) < 1e-10
    for i, (start, end) in enumerate(itertools.pairwise(cu.tolist())):
        doc = {name: x[name][start:end].unsqueeze(0) for name in ("q", "k", "v", "g", "beta")}
        for fn in (tq.torch_chunk_gated_delta_rule, tq.torch_recurrent_gated_delta_rule):
            o_hf, s_hf = fn(
                doc["q"],
                doc["k"],
                doc["v"],
                g=doc["g"],
                beta=doc["beta"],
                initial_state=x["initial_state"][i : i + 1],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            # transformers casts every input to float32 whatever its dtype: agreement is float32-level
            # (|o|, |S| ~ 1, ≤ 130 steps: ~1e-6 measured).
            assert max_err(o_hf[0], o[start:end]) < 1e-4 and max_err(s_hf[0], s[i]) < 1e-4

    gen = torch.Generator().manual_seed(14)
    D, K = 6, 4
    xc = torch.randn(sum(lens), D, generator=gen, dtype=F64)
    w, b = torch.randn(D, K, generator=gen, dtype=F64), torch.randn(D, generator=gen, dtype=F64)
    ours = causal_conv1d(xc, w, cu, bias=b, activation="silu")
    for start, end in itertools.pairwise(cu.tolist()):
        hf = tq.causal_conv1d_fn(xc[start:end].t().unsqueeze(0), w, b, activation="silu")
        assert max_err(hf[0].t(), ours[start:end]) < 1e-13

    for dtype in (torch.float32, torch.bfloat16):  # same rounding steps as transformers: equal bit for bit
        core = torch.randn(7, 4, 8, generator=gen).to(dtype)
        gate = torch.randn(7, 4, 8, generator=gen).to(dtype)
        norm = tq.Qwen3_5RMSNormGated(8, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(8, generator=gen))
            assert torch.equal(gated_rms_norm(core, gate, norm.weight, eps=1e-6), norm(core, gate))


def backward_bytes_per_token(T: int, scan: str) -> float:
    """Bytes of every tensor created during the backward of ``gated_delta_core`` on one T-token sequence, per token.

    Counted as the outputs of every aten op autograd runs (a TorchDispatchMode): a deterministic measure of
    the backward's memory traffic, not a timing.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from ringtune.ops.gated_delta.core import gated_delta_core

    class CountBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    CountBytes.total += t.numel() * t.element_size()
            return out

    x = make_inputs((T,), H=2, Hk=1, Dk=4, Dv=4, initial=False, seed=11)
    w = torch.randn(2 * 4 + 2 * 4, 4, dtype=F64, requires_grad=True)
    o = gated_delta_core(x["q"], x["k"], x["v"], cu_of((T,)), g=x["g"], beta=x["beta"], conv_weight=w, scan=scan)
    loss = o.square().sum()
    with CountBytes():
        loss.backward()
    return CountBytes.total / T


@pytest.mark.parametrize("scan", ["recompute", "autograd"])
def test_chunked_backward_traffic_is_linear_in_tokens(scan):
    # The scan splits its [chunks, ...] tensors into per-step views once; indexing them at every step instead
    # makes autograd write a zero gradient of the whole tensor per step: bytes per token would grow ~4x here.
    # Both scans (the recomputing one runs the same steps inside its backward; many segments: its own test file).
    short, long = backward_bytes_per_token(16 * 16, scan), backward_bytes_per_token(64 * 16, scan)
    assert long / short < 1.1, (short, long)
