"""The state sweep after AdamW (:mod:`ringtune.engine.state_sweep`): the checksums equal a one-pass wrapping sum
of the raw bits bit for bit (several chunks, every width), the maxima equal :func:`max_abs` (NaN / inf included),
and :class:`StateMaxima` hands back a recorded maximum only while its tensor is unchanged."""

from __future__ import annotations

import torch

from ringtune.engine import state_sweep
from ringtune.engine.state_sweep import StateMaxima, checksums_and_max_abs
from ringtune.engine.tensor_norms import max_abs

BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def one_pass(t: torch.Tensor) -> int:
    x = t.detach().contiguous().reshape(-1)
    return int(x.view(BITS[x.element_size()]).sum(dtype=BITS[x.element_size()]).to(torch.int64))


def test_chunked_checksums_and_maxima_equal_the_one_pass_reductions(monkeypatch) -> None:
    monkeypatch.setattr(state_sweep, "CHUNK_BYTES", 64)  # many chunks per tensor, a ragged last one
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(1000, generator=gen) * 1e30,  # int32 sums that wrap
        torch.randn(37, 5, generator=gen, dtype=torch.float64),
        torch.randn(333, generator=gen).to(torch.bfloat16),
        torch.randn(77, generator=gen).to(torch.float16),
        torch.tensor(7.0),  # a 0-d AdamW step count
        torch.arange(100, dtype=torch.int64),  # a buffer: checksum only
        torch.zeros(0),
    ]
    tensors[1][3, 2] = float("nan")
    tensors[2][200] = float("-inf")
    sums, peaks = checksums_and_max_abs(tensors)
    assert sums.tolist() == [one_pass(t) for t in tensors]
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    want = max_abs([tensors[i] for i in floats])
    got = peaks[floats]
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert peaks[5] == 0  # not a float: no maximum
    _, some = checksums_and_max_abs(tensors, [True, False, False, False, False, False, False])
    assert some[0] == want[0] and not some[1:].any()


def test_recorded_maxima_are_used_only_while_the_tensor_is_unchanged() -> None:
    a, b = torch.nn.Parameter(torch.tensor([1.0, -3.0])), torch.tensor([2.0, 0.5])
    record = StateMaxima()
    record.record([a, b], torch.tensor([10.0, 20.0], dtype=torch.float64))  # planted, to see where they come from
    assert record.lookup([a, b]).tolist() == [10.0, 20.0]
    assert record.lookup([b, torch.tensor([-4.0])]).tolist() == [20.0, 4.0]  # another tensor is read
    with torch.no_grad():
        a[1] = float("nan")  # an in-place write bumps the version counter
    assert record.lookup([a, b])[0].isnan() and record.lookup([a, b])[1] == 20.0
    b.mul_(2)
    assert record.lookup([b]).tolist() == [4.0]
    b.data = torch.tensor([5.0, 6.0])  # new storage behind the same object
    assert record.lookup([b]).tolist() == [6.0]
    record.forget()
    assert record.lookup([a]).isnan().all()
