"""The recomputing chunked scan (``chunk_scan_recompute.py``) against the scan autograd keeps whole (``chunk_scan.py``).

float64 outputs, final states and every input gradient equal within 1e-12 on packed rows of many short
sequences, sequences longer than a chunk and lengths off the chunk grid, with and without initial state,
for segments of one chunk up to the whole row (a step of more sequences than a segment holds is cut into
blocks); the states-only form of the affine summary; under ``torch.utils.checkpoint``; what autograd keeps
(saved-tensor hooks) and the backward's traffic staying linear in tokens with many segments.
"""

from __future__ import annotations

import pytest
import torch
from test_gated_delta import cu_of, make_inputs, max_err, run
from torch.utils.checkpoint import checkpoint

from ringtune.ops.gated_delta import (
    chunk_gated_delta_rule,
    gated_delta_affine_summary,
    gated_delta_chunk_scan,
    prepare_gated_delta_inputs,
    recomputing_chunk_scan,
)
from ringtune.ops.gated_delta.chunk_scan import chunk_pieces, scan_layout, scan_steps
from ringtune.ops.gated_delta.chunk_scan_grad import segment_gradients
from ringtune.ops.gated_delta.chunk_scan_recompute import chunk_bytes, tile_segments

F64 = torch.float64
C = 16  # small chunks: many chunks and steps on short rows
PACKED = (1, 17, 3, 5, 40, 16, 2, 33, 9, 1, 64, 7, 0, 12, 4, 15, 6, 11)  # 1–17 tokens, longer than a chunk, off-grid
LIMIT = 1e-12


def rule(segment_chunks: int | None, *, use_qk_l2norm: bool = False, chunk_size: int = C):
    """chunk_gated_delta_rule's contract on the recomputing scan with ``segment_chunks`` chunks per segment, or
    (None) the rule on the autograd scan."""

    def fn(q, k, v, cu, *, g, beta, initial_state=None):
        if segment_chunks is None:
            return chunk_gated_delta_rule(
                q, k, v, cu, g=g, beta=beta, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                chunk_size=chunk_size, scan="autograd",
            )  # fmt: skip
        budget = segment_chunks * chunk_bytes(v.shape[1], chunk_size, k.shape[2], v.shape[2], 8)
        prepared = prepare_gated_delta_inputs(q, k, v, g, beta, scale=None, use_qk_l2norm=use_qk_l2norm)
        return recomputing_chunk_scan(
            *prepared, cu.tolist(), initial_state, chunk_size=chunk_size, segment_bytes=budget
        )

    return fn


def assert_equal_runs(got, want, limit=LIMIT):
    (o, s, grads), (o_ref, s_ref, g_ref) = got, want
    assert o.dtype == F64 and o.shape == o_ref.shape and s.shape == s_ref.shape
    assert max_err(o, o_ref) < limit
    assert max_err(s, s_ref) < limit
    assert grads.keys() == g_ref.keys()
    for name, grad in grads.items():
        assert max_err(grad, g_ref[name]) < limit, name


def test_segments_tile_every_chunk_once():
    layout = scan_layout(cu_of(PACKED).tolist(), C, torch.device("cpu"))
    for size in (1, 2, 3, 5, 8, 1000):
        groups = tile_segments(layout, size)
        rows = torch.cat([seg.rows for blocks in groups for seg in blocks])
        assert torch.equal(rows.sort().values, torch.arange(layout.offsets[-1]))
        assert all(len(seg.rows) <= size or len(seg.steps) == 1 for blocks in groups for seg in blocks)
        assert all(sum(seg.steps) == len(seg.rows) <= max(size, 1) for blocks in groups for seg in blocks)
    assert len(tile_segments(layout, 1000)) == 1 and len(tile_segments(layout, 1)[0]) == layout.active[0]


@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("segment_chunks", [1, 2, 5, 1000])
def test_equals_autograd_scan_on_packed_rows(initial, segment_chunks):
    x = make_inputs(PACKED, H=4, Hk=2, initial=initial, long_memory=True, seed=21)
    cu = cu_of(PACKED)
    want = run(rule(None, chunk_size=C), x, cu)
    assert_equal_runs(run(rule(segment_chunks), x, cu), want)


@pytest.mark.parametrize("lens", [(200,), (130, 1, 70), (64, 64)], ids=["one_long", "long_short_long", "on_grid"])
def test_equals_autograd_scan_on_long_sequences(lens):
    x = make_inputs(lens, normalise_k=False, long_memory=True, seed=22)
    cu = cu_of(lens)
    want = run(rule(None, chunk_size=C, use_qk_l2norm=True), x, cu)
    assert_equal_runs(run(rule(3, use_qk_l2norm=True), x, cu), want)


def test_default_rule_and_no_final_state():
    x = make_inputs(PACKED, seed=23)
    cu = cu_of(PACKED)
    assert_equal_runs(run(chunk_gated_delta_rule, x, cu), run(rule(None, chunk_size=64), x, cu))
    o, none = chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], output_final_state=False)
    assert none is None
    grads = torch.autograd.grad(o.square().sum(), [x[n] for n in ("q", "k", "v", "g", "beta")])
    o_ref, _ = chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], scan="autograd")
    ref = torch.autograd.grad(o_ref.square().sum(), [x[n] for n in ("q", "k", "v", "g", "beta")])
    assert max_err(o, o_ref) < LIMIT and all(max_err(a, b) < LIMIT for a, b in zip(grads, ref, strict=True))
    with pytest.raises(ValueError, match="scan='fast': choose one of recompute, autograd"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu, g=x["g"], beta=x["beta"], scan="fast")


def test_states_only_scan_and_affine_summary():
    lens = (1, 50, 17, 0, 33)
    x = make_inputs(lens, long_memory=True, seed=24)
    _, k, v, g, beta = prepare_gated_delta_inputs(
        None, x["k"], x["v"], x["g"], x["beta"], scale=None, use_qk_l2norm=True
    )
    bounds, s0 = cu_of(lens).tolist(), x["initial_state"]
    budget = 2 * chunk_bytes(2, C, 16, 12, 8)
    _, got = recomputing_chunk_scan(None, k, v, g, beta, bounds, s0, chunk_size=C, segment_bytes=budget)
    _, want = gated_delta_chunk_scan(None, k, v, g, beta, bounds, s0, chunk_size=C)
    ds = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    leaves = [x[n] for n in ("k", "v", "g", "beta", "initial_state")]
    grads = torch.autograd.grad((got * ds).sum(), leaves, retain_graph=True)  # the preparation is shared
    ref = torch.autograd.grad((want * ds).sum(), leaves)
    assert max_err(got, want) < LIMIT and all(max_err(a, b) < LIMIT for a, b in zip(grads, ref, strict=True))
    summary = [
        gated_delta_affine_summary(x["k"], x["v"], cu_of(lens), g=x["g"], beta=x["beta"], scan=s)
        for s in ("recompute", "autograd")
    ]
    assert all(max_err(a, b) < LIMIT for a, b in zip(*summary, strict=True))


def test_under_checkpoint():
    x = make_inputs(PACKED, H=4, Hk=2, seed=25)
    cu = cu_of(PACKED)

    def checkpointed(q, k, v, cu, **kw):
        return checkpoint(lambda *a: rule(2)(*a, cu, **kw), q, k, v, use_reentrant=False, early_stop=False)

    assert_equal_runs(run(checkpointed, x, cu), run(rule(None, chunk_size=C), x, cu))


def saved_bytes_per_token(scan: str, T: int) -> float:
    """Bytes of the distinct storages autograd keeps for the backward of the rule on one T-token sequence, per token."""
    x = make_inputs((T,), H=4, Hk=2, Dk=16, Dv=16, initial=False, seed=26, dtype=torch.float32)
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], cu_of((T,)), g=x["g"], beta=x["beta"], chunk_size=C, scan=scan)
    return sum(storages.values()) / T


def test_keeps_only_inputs():
    # q and k expanded to the 4 value heads and scaled, v, g, beta: 4·(16 + 16 + 16 + 1 + 1) floats per token.
    inputs = 4 * (3 * 16 + 2) * 4
    assert saved_bytes_per_token("recompute", 1024) == inputs
    assert saved_bytes_per_token("autograd", 1024) > 5 * inputs  # the intra-chunk matrices, U, W, states, ...


def backward_bytes_per_token(T: int, segment_chunks: int) -> float:
    """Bytes of every new tensor storage the backward's aten ops create, per token.

    As test_gated_delta.py's twin, except that outputs sharing a storage with an input (views, in-place writes
    such as the ``index_copy_`` of a segment's gradient rows into the preallocated gradient) count nothing: they
    create no memory, and an in-place write touches only the rows it writes.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def storages(tree) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}

    class CountBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = storages((args, kwargs))
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            new = [t for t in tensors if t.untyped_storage().data_ptr() not in seen]
            CountBytes.total += sum(t.untyped_storage().nbytes() for t in new)
            return out

    x = make_inputs((T,), H=2, Dk=4, Dv=4, initial=False, seed=27)
    o, _ = rule(segment_chunks)(x["q"], x["k"], x["v"], cu_of((T,)), g=x["g"], beta=x["beta"])
    loss = o.square().sum()
    with CountBytes():
        loss.backward()
    return CountBytes.total / T


def test_backward_traffic_is_linear_with_many_segments():
    # 4 chunks per segment: 4 and 16 segments. Creating a full-size tensor per segment (a padded copy of an
    # input, a zero-filled gradient) would grow the bytes per token with the number of segments.
    short, long = backward_bytes_per_token(16 * C, 4), backward_bytes_per_token(64 * C, 4)
    assert long / short < 1.1, (short, long)


@pytest.mark.parametrize(
    ("steps", "with_state", "with_exit", "with_q", "with_outputs"),
    [
        ([3, 3, 2, 1], True, True, True, True),  # sequences leave after steps 1, 2 and 3
        ([3, 3, 2, 1], False, True, True, True),  # the first step from zeros
        ([2, 2], True, False, True, True),  # no state gradient at the exit
        ([3, 2], True, True, True, False),  # no output gradient: q gets zeros
        ([3, 1], True, True, False, False),  # states only (no queries)
        ([4, 2, 2], False, False, True, True),
    ],
)
def test_hand_written_rectangle_backward_equals_autograd(steps, with_state, with_exit, with_q, with_outputs):
    """``segment_gradients`` against autograd through ``scan_steps(chunk_pieces(...))`` on the same rectangle,
    float64, every input and the start state; a wrong term (the exit gradient dropped) is caught."""
    gen = torch.Generator().manual_seed(sum(steps) + 10 * with_state + 100 * with_exit)
    H, D, R = 2, 8, sum(steps)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    qc = torch.nn.functional.normalize(randn(R, H, C, D), dim=-1) / 3 if with_q else None
    kc = torch.nn.functional.normalize(randn(R, H, C, D), dim=-1)
    vc, bc = randn(R, H, C, D), torch.rand(R, H, C, generator=gen, dtype=F64)
    gc = -torch.rand(R, H, C, generator=gen, dtype=F64)
    S0 = randn(steps[0], H, D, D) if with_state else None
    leaves = [None if x is None else x.clone().requires_grad_() for x in (qc, kc, vc, gc, bc, S0)]
    outs, states = scan_steps(chunk_pieces(*leaves[:5]), steps, leaves[5])
    d_outs = [randn(*o.shape) for o in outs] if with_outputs else None
    d_exit = randn(*states.shape) if with_exit else None
    outputs = (outs if with_outputs else []) + ([states] if with_exit else [])
    cotangents = (d_outs or []) + ([d_exit] if with_exit else [])
    wrt = [x for x in leaves if x is not None]
    want = torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True, materialize_grads=True)
    got = [x for x in segment_gradients(qc, kc, vc, gc, bc, steps, S0, d_outs, d_exit) if x is not None]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert max_err(a, b) < 1e-13
    if with_exit:  # negative control: dk without the exit gradient is wrong
        dropped = segment_gradients(qc, kc, vc, gc, bc, steps, S0, d_outs, None)
        assert max_err(dropped[1], want[1 if with_q else 0]) > 1e-6
