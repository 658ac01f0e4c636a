"""Fused reductions (engine/tensor_norms.py) against per-tensor float64 references, empty tensors included; and
the replicated gradient buckets (engine/gradients.py gradient_buckets)."""

from __future__ import annotations

import math

import torch

from ringtune.engine import tensor_norms
from ringtune.engine.gradients import gradient_buckets
from ringtune.engine.tensor_norms import (
    count_non_finite,
    max_abs,
    squares_and_max_abs,
    squares_and_norms,
    sum_of_squares,
)


def test_sum_of_squares_is_the_float64_sum() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(33, 7, generator=gen), torch.zeros(0), torch.randn(5, generator=gen) * 1e20]
    want = sum(float(t.double().pow(2).sum()) for t in tensors)
    got = float(sum_of_squares(tensors))
    assert math.isclose(got, want, rel_tol=1e-14)  # accumulated in float64: 1e20² does not overflow as in float32
    assert float(sum_of_squares([])) == 0.0
    assert math.isinf(float(sum_of_squares([torch.tensor([1.0, math.inf])])))
    assert math.isnan(float(sum_of_squares([torch.tensor([1.0, math.nan])])))


def test_squares_and_max_abs_read_once_equal_the_two_reductions(monkeypatch) -> None:
    """Across chunk boundaries (a 7-element chunk here) and mixed dtypes: the one-sweep pair equals
    sum_of_squares and max_abs bit for bit, the sum the float64 sum of the widened squares, NaN / inf kept."""
    monkeypatch.setattr(tensor_norms, "CHUNK_ELEMENTS", 7)
    gen = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(5, 6, generator=gen),
        torch.zeros(0),
        torch.randn(9, generator=gen, dtype=torch.float64),
        (torch.randn(15, generator=gen) * 3).to(torch.bfloat16),
        torch.randn(7, generator=gen),
    ]
    squares, maxima = squares_and_max_abs(tensors)
    assert torch.equal(squares, sum_of_squares(tensors)) and torch.equal(maxima, max_abs(tensors))
    want = sum(float(t.double().pow(2).sum()) for t in tensors)
    assert math.isclose(float(squares), want, rel_tol=1e-14)
    assert maxima.tolist() == [float(t.double().abs().max()) if t.numel() else 0.0 for t in tensors]
    tensors[0][4, 5] = math.nan  # in the last chunk of a tensor that spans five
    tensors[4][0] = -math.inf
    squares, maxima = squares_and_max_abs(tensors)
    assert math.isnan(float(squares)) and math.isnan(float(maxima[0])) and math.isinf(float(maxima[4]))


def test_squares_and_norms_keep_the_sum_and_bound_each_maximum(monkeypatch) -> None:
    """The sum of squares is sum_of_squares' bit for bit (chunked, mixed dtypes); each tensor's own norm is the
    float64 norm of its elements, at least its max |t_i| (to the last bits), non-finite with a NaN / inf."""
    monkeypatch.setattr(tensor_norms, "CHUNK_ELEMENTS", 7)
    gen = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(5, 6, generator=gen),
        torch.zeros(0),
        torch.randn(9, generator=gen, dtype=torch.float64),
        (torch.randn(15, generator=gen) * 3).to(torch.bfloat16),
        torch.tensor([0.0, -1e30, 0.0]),  # one dominating element: the norm is the max
    ]
    squares, norms = squares_and_norms(tensors)
    assert torch.equal(squares, sum_of_squares(tensors))
    for t, norm in zip(tensors, norms.tolist(), strict=True):
        own = math.sqrt(float(t.double().pow(2).sum())) if t.numel() else 0.0
        assert math.isclose(norm, own, rel_tol=1e-14, abs_tol=0.0)
        peak = float(t.double().abs().max()) if t.numel() else 0.0
        assert norm >= peak * (1 - 1e-15)
    tensors[0][4, 5] = math.nan
    tensors[3][0] = -math.inf
    squares, norms = squares_and_norms(tensors)
    assert math.isnan(float(squares)) and math.isnan(float(norms[0])) and math.isinf(float(norms[3]))
    assert norms[1:3].isfinite().all()


def test_max_abs_propagates_nan_and_inf_and_counts_them() -> None:
    tensors = [torch.tensor([-4.0, 2.0]), torch.zeros(0), torch.tensor([math.nan, 1.0]), torch.tensor([-math.inf])]
    got = max_abs(tensors)
    assert got.dtype == torch.float64 and got[:2].tolist() == [4.0, 0.0]
    assert math.isnan(float(got[2])) and math.isinf(float(got[3]))
    assert float(count_non_finite(tensors)) == 2.0 and float(count_non_finite(tensors[:2])) == 0.0


def test_gradient_buckets_keep_order_dtype_and_size() -> None:
    f32 = [torch.zeros(256) for _ in range(5)]  # 1 KiB each
    f64 = torch.zeros(8, dtype=torch.float64)
    big = torch.zeros(4096)
    buckets = gradient_buckets([*f32, f64, big, f32[0]], bucket_bytes=2048)
    assert [len(b) for b in buckets] == [2, 2, 1, 1, 1, 1]
    assert [id(t) for b in buckets for t in b] == [id(t) for t in (*f32, f64, big, f32[0])]
    assert all(len({t.dtype for t in b}) == 1 for b in buckets)
