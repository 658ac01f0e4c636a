"""Plain single-process reference of causal varlen attention over one packed THD row.

Used by every test as the oracle. It materialises the [T_i × T_i] score matrix of each sequence, so
it is for test-sized rows only.
"""

from __future__ import annotations

import itertools
import math

import torch


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention where each token attends only to earlier tokens of its own sequence.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq divisible by Hkv (GQA: query head h uses kv head
            ``h // (Hq // Hkv)``).
        cu_seqlens: int64 [n+1] boundaries of the sequences in the row (0 first, T last).
        scale: softmax scale, default ``1/sqrt(D)``.
    Returns:
        ``(out [T, Hq, D], lse [T, Hq])``; lse is the log-sum-exp of the scaled scores of each query
        (float64 for float64 inputs, float32 otherwise). Differentiable by autograd.
    """
    _T, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs = [q[:0]]  # an empty row still has a graph, so a backward through it works
    lses = [q[:0, :, 0].to(acc)]
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (x[start:end].transpose(0, 1).to(acc) for x in (q, k, v))  # [H, n, D]
        scores = (qs @ ks.transpose(1, 2)) * scale
        n = end - start
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, n]
        probs = torch.exp(scores - lse.unsqueeze(-1))
        outs.append((probs @ vs).transpose(0, 1).to(q.dtype))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)
