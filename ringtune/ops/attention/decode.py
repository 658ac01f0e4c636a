"""Decode attention: one new query per sequence against that sequence's KV cache, for a batch of sequences.

Row ``b`` of the batch holds a sequence whose first ``lengths[b]`` cached keys/values are valid (the new
token's own K/V already appended, so it attends to itself, as the last row of causal attention does).
The cache is a padded buffer ``[B, Hkv, capacity, D]``; slots at or beyond ``lengths[b]`` are ignored
whatever finite values they hold (:class:`ringtune.models.batch_cache.KVRows` keeps zeros or stale keys there;
a NaN would leak through ``0 · NaN``). :func:`decode_attention` is batched (torch's fused SDPA with a length
mask); :func:`reference_decode_attention` is the plain per-row oracle beside it (it also returns the
log-sum-exp). Both equal the last row of :func:`reference_varlen_attention` over the sequence.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"q must be [B, Hq, D] and k, v [B, Hkv, capacity, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    B, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1]:
        raise ValueError(f"k must be [B={B}, Hkv | Hq={Hq}, capacity, D={D}]; got {tuple(k.shape)}")
    if lengths.shape != (B,) or lengths.dtype != torch.int64:
        raise ValueError(f"lengths must be int64 [B={B}]; got {lengths.dtype} {tuple(lengths.shape)}")
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > k.shape[2]):
        raise ValueError(f"lengths must be in [1, capacity={k.shape[2]}]; got {lengths.tolist()}")


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its cached keys (torch's fused SDPA with a length mask).

    Args:
        q: [B, Hq, D]; k, v: [B, Hkv, capacity, D] (GQA: query head h reads kv head ``h // (Hq/Hkv)``).
        lengths: int64 [B], the valid keys of each row (1 ≤ lengths ≤ capacity).
        scale: softmax scale, default ``1/sqrt(D)``.
    Returns:
        out [B, Hq, D] in q.dtype (float32 accumulation; float64 math for float64 inputs); only the first
        ``max(lengths)`` slots are read. The log-sum-exp is not needed when decoding and not returned (the
        oracle :func:`reference_decode_attention` returns it, for the tests).
    """
    _check(q, k, v, lengths)
    B, _, D = q.shape
    if B == 0:
        return q.clone()
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    S = int(lengths.max())
    valid = torch.arange(S, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k[:, :, :S], v[:, :, :S], attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def reference_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain per-row oracle of :func:`decode_attention` (same contract): softmax over ``k[b, :, :lengths[b]]``."""
    _check(q, k, v, lengths)
    B, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for b in range(B):
        n = int(lengths[b])
        kb = k[b, :, :n].repeat_interleave(group, dim=0).to(acc)  # [Hq, n, D]
        vb = v[b, :, :n].repeat_interleave(group, dim=0).to(acc)
        scores = torch.einsum("hd,hnd->hn", q[b].to(acc), kb) * scale
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), vb).to(q.dtype))
        lses.append(lse)
    if not outs:
        return q.clone(), q.new_zeros(0, Hq, dtype=acc)
    return torch.stack(outs), torch.stack(lses)
