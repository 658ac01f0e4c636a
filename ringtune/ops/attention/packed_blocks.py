"""Blocks of a row packed into varlen kernel calls: one call per group instead of one per block.

A *group* is a list of :class:`BlockPair` with one ``causal`` flag whose query ranges do not overlap (their key
ranges may). :func:`varlen_groups` splits a block list into as few groups as a greedy interval colouring gives:
a ring step's blocks (one per sequence) are one group; the all-gather blocks (a full and a causal block per
chunk) two. Per group the query rows, and the key rows of each block in block order, are gathered into THD
buffers (``q`` [Nq, Hq, D], ``k``/``v`` [Nk, Hkv, D]) with int32 ``cu_q``/``cu_k``, and the kernel runs once
(``forward_varlen`` / ``backward_varlen``, see ``flash_cuda.py``). Inputs are heads-major ([1, H, T, D]) as in
``blocks.py``; no query row is computed twice within a group, so merging a group's output is a gather, a merge
and a scatter of its rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ringtune.ops.attention.merge import merge_block
from ringtune.ops.attention.schedule import BlockPair


def varlen_groups(pairs: list[BlockPair]) -> list[list[BlockPair]]:
    """``pairs`` split into groups of one ``causal`` flag and disjoint query ranges (each group sorted by q_start)."""
    groups: list[list[BlockPair]] = []
    ends: list[int] = []
    for p in sorted(pairs, key=lambda p: (p.q_start, p.q_end)):
        for i, g in enumerate(groups):
            if g[0].causal == p.causal and ends[i] <= p.q_start:
                g.append(p)
                ends[i] = p.q_end
                break
        else:
            groups.append([p])
            ends.append(p.q_end)
    return groups


@dataclass(frozen=True)
class PackedGroup:
    """Index tensors of one group: query rows ``q_idx`` [Nq], key rows ``k_idx`` [Nk], ``cu_q``/``cu_k`` [n+1]."""

    pairs: list[BlockPair]
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def causal(self) -> bool:
        return self.pairs[0].causal

    @classmethod
    def of(cls, pairs: list[BlockPair], device: torch.device) -> PackedGroup:
        def rows(spans):
            parts = [torch.arange(a, b, dtype=torch.int64, device=device) for a, b in spans]
            return torch.cat(parts).to(device)

        def cum(lens):
            return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

        qs = [(p.q_start, p.q_end) for p in pairs]
        ks = [(p.k_start, p.k_end) for p in pairs]
        q_lens, k_lens = [b - a for a, b in qs], [b - a for a, b in ks]
        return cls(pairs, rows(qs), rows(ks), cum(q_lens), cum(k_lens), max(q_lens), max(k_lens))

    def gather(self, x_h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` of heads-major ``x_h`` [1, H, T, D] as a contiguous THD copy [N, H, D]."""
        return x_h[0].index_select(1, idx).transpose(0, 1).contiguous()

    def gather_qkv(
        self, q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group's query rows of ``q_h`` [1, Hq, T, D] and key rows of ``k_h``/``v_h`` [1, Hkv, T, D], as THD
        copies ([Nq, Hq, D], [Nk, Hkv, D], [Nk, Hkv, D]): a varlen kernel's q, k, v."""
        return self.gather(q_h, self.q_idx), self.gather(k_h, self.k_idx), self.gather(v_h, self.k_idx)

    def varlen_bounds(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``(cu_q, cu_k, max_q, max_k)``: the varlen kernel's sequence bounds (int32 [n+1]) and longest spans."""
        return self.cu_q, self.cu_k, self.max_q, self.max_k


def forward_packed(
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    pairs: list[BlockPair],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    kernel,
    fresh: bool,
) -> None:
    """:func:`~ringtune.ops.attention.blocks.forward_blocks` by a varlen kernel: one call per group, merged in place."""
    for group in varlen_groups(pairs):
        pk = PackedGroup.of(group, q_h.device)
        g_out, g_lse = kernel.forward_varlen(
            *pk.gather_qkv(q_h, k_h, v_h), *pk.varlen_bounds(), causal=pk.causal, scale=scale
        )
        block_out = g_out.transpose(0, 1).to(out.dtype)  # [H, Nq, D]
        block_lse = g_lse.to(lse.dtype)  # [H, Nq]
        if not fresh:  # merge into copies of the group's rows, then write them back
            rows_out, rows_lse = out[0].index_select(1, pk.q_idx), lse[0].index_select(1, pk.q_idx)
            merge_block(rows_out, rows_lse, block_out, block_lse)
            block_out, block_lse = rows_out, rows_lse
        out[0].index_copy_(1, pk.q_idx, block_out)
        lse[0].index_copy_(1, pk.q_idx, block_lse)


def grads_packed(
    dout_h: torch.Tensor,
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    out_h: torch.Tensor,
    lse_h: torch.Tensor,
    pairs: list[BlockPair],
    dq: torch.Tensor,
    *,
    scale: float,
    kernel,
) -> Iterator[tuple[BlockPair, torch.Tensor, torch.Tensor]]:
    """:func:`~ringtune.ops.attention.blocks.block_grads` by a varlen kernel: per group one backward call, its dq
    added to ``dq`` (in place), then ``(pair, dk, dv)`` of each block ([1, Hkv, k_end - k_start, D], input dtype)."""
    for group in varlen_groups(pairs):
        pk = PackedGroup.of(group, q_h.device)
        g_dq, g_dk, g_dv = kernel.backward_varlen(
            pk.gather(dout_h, pk.q_idx),
            *pk.gather_qkv(q_h, k_h, v_h),
            pk.gather(out_h, pk.q_idx),
            lse_h[0].index_select(1, pk.q_idx),
            *pk.varlen_bounds(),
            causal=pk.causal,
            scale=scale,
        )
        dq[0].index_add_(1, pk.q_idx, g_dq.transpose(0, 1).to(dq.dtype))
        del g_dq
        bounds = pk.cu_k.tolist()
        for p, a, b in zip(group, bounds[:-1], bounds[1:], strict=True):
            yield p, g_dk[a:b].transpose(0, 1).unsqueeze(0), g_dv[a:b].transpose(0, 1).unsqueeze(0)
