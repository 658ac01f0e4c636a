"""ringtune.ops.attention.decode: one query per sequence against a padded KV cache, batched vs per-row oracle.

Both must equal the last row of causal varlen attention over each sequence (the reference of every attention
test), for GQA and sequences of different lengths in one batch; slots past a row's length must not matter
(they hold 1e30 garbage; the valid part is written over NaN, so an unwritten slot would show). float64: 1e-12.
"""

from __future__ import annotations

import pytest
import torch

from ringtune.ops.attention import reference_varlen_attention
from ringtune.ops.attention.decode import decode_attention, reference_decode_attention
from tests.sample_fixtures import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
LENS = (1, 2, 9, 33)


def cache_of(lens, *, Hq=4, Hkv=2, D=8, capacity=40, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, Hq, D, generator=gen, dtype=F64).to(dtype) for n in lens]
    ks = [torch.randn(n, Hkv, D, generator=gen, dtype=F64).to(dtype) for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=gen, dtype=F64).to(dtype) for n in lens]
    k = torch.full((len(lens), Hkv, capacity, D), float("nan"), dtype=dtype)
    v = k.clone()
    for b, n in enumerate(lens):
        k[b, :, :n], v[b, :, :n] = ks[b].transpose(0, 1), vs[b].transpose(0, 1)
        k[b, :, n:], v[b, :, n:] = 1e30, -1e30  # finite garbage past the length
    q = torch.stack([x[-1] for x in qs])
    return q, k, v, torch.tensor(lens), (qs, ks, vs)


def last_rows_of_reference(qs, ks, vs):
    lens = [x.shape[0] for x in qs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out, lse = reference_varlen_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu)
    last = cu[1:] - 1
    return out[last], lse[last]


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_decode_equals_last_row_of_causal_attention(heads):
    Hq, Hkv = heads
    q, k, v, lengths, parts = cache_of(LENS, Hq=Hq, Hkv=Hkv)
    want_out, want_lse = last_rows_of_reference(*parts)
    ref_out, ref_lse = reference_decode_attention(q, k, v, lengths)
    assert (ref_out - want_out).abs().max() < 1e-12 and (ref_lse - want_lse).abs().max() < 1e-12
    out = decode_attention(q, k, v, lengths)
    assert not out.isnan().any() and (out - want_out).abs().max() < 1e-12


def test_float32_close_to_float64():
    q, k, v, lengths, _ = cache_of(LENS, dtype=torch.float32)
    out = decode_attention(q, k, v, lengths)
    want, _ = reference_decode_attention(q.double(), k.double(), v.double(), lengths)
    assert out.dtype == torch.float32
    # unit-variance inputs, softmax over <= 33 keys: a few float32 roundings of O(1) values
    assert (out.double() - want).abs().max() < 1e-5


def test_negative_control_length_matters():
    q, k, v, lengths, parts = cache_of(LENS)
    k[:, :, max(LENS) :], v[:, :, max(LENS) :] = 0.0, 0.0
    for b, n in enumerate(LENS):
        k[b, :, n:], v[b, :, n:] = 0.5, 0.5
    want, _ = last_rows_of_reference(*parts)
    out = decode_attention(q, k, v, lengths + 1)  # one stale slot read
    assert (out - want).abs().max() > 1e-3


def test_bad_lengths():
    q, k, v, lengths, _ = cache_of(LENS)
    with pytest.raises(ValueError, match="lengths must be in"):
        decode_attention(q, k, v, torch.tensor([0, 1, 1, 1]))
    with pytest.raises(ValueError, match="lengths must be int64"):
        decode_attention(q, k, v, lengths.int())
