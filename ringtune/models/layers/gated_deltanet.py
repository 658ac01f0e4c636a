"""Qwen3.5's GatedDeltaNet (linear attention) layer over a packed shard, with HF parameter names.

``x -> in_proj_qkv -> depthwise causal conv (SiLU) -> q/k L2 norm -> gated delta rule -> gated RMSNorm
(by in_proj_z) -> out_proj``, gates ``g = -exp(A_log)·softplus(in_proj_a(x) + dt_bias)`` and
``beta = sigmoid(in_proj_b(x))``. Under CP the conv + delta rule run by the shard's mode (headwise:
all-to-all to head shards; chunkwise: contiguous parts with a state hand-off) over the CP group; the
projections, gates and output norm are per token.
"""

from __future__ import annotations

import torch
from torch import nn

from ringtune.models.batch_cache import GatedDeltaRows
from ringtune.models.cache import LayerCapture
from ringtune.models.shard import PackedShard
from ringtune.ops.gated_delta.core import gated_delta_core
from ringtune.ops.gated_delta.cp import gdn_cp_fn
from ringtune.ops.gated_delta.cp_headwise import check_headwise_heads
from ringtune.ops.gated_delta.gates import gdn_gates
from ringtune.ops.gated_delta.norm import gated_rms_norm
from ringtune.ops.gated_delta.prefill import gated_delta_prefill
from ringtune.ops.gated_delta.recurrent import gated_delta_decode_core
from ringtune.ops.linear import Linear


class GatedDeltaNet(nn.Module):
    """One GatedDeltaNet layer; parameters named as transformers' ``Qwen3_5GatedDeltaNet``.

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: linear key/query heads and value heads (``num_v_heads % num_k_heads == 0``).
        head_k_dim, head_v_dim: per-head dims.
        conv_kernel: depthwise conv width K.
        rms_norm_eps: eps of the gated output norm.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        rms_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.eps = rms_norm_eps
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = Linear(hidden_size, conv_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False, padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0.01, 16)))
        self.norm = _GatedNormWeight(head_v_dim)
        self.out_proj = Linear(value_dim, hidden_size, bias=False)

    def check_cp(self, cp_size: int, mode: str) -> None:
        """Raise ParallelConfigError if this layer's heads do not fit GDN CP ``mode`` at ``cp_size``."""
        if mode == "headwise":
            check_headwise_heads(self.num_k_heads, self.num_v_heads, cp_size)

    def _project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> raw q, k [T, Hk, Dk], v [T, Hv, Dv], gates g, beta [T, Hv], conv weight [channels, K]."""
        T = x.shape[0]
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        q, k, v = self.in_proj_qkv(x).split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv)
        g, beta = gdn_gates(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        return q, k, v, g, beta, self.conv1d.weight.squeeze(1)

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Core output o [T, Hv, Dv] -> [T, hidden]: gated RMSNorm by ``in_proj_z(x)``, then ``out_proj``."""
        T, hv, dv = x.shape[0], self.num_v_heads, self.head_v_dim
        z = self.in_proj_z(x).reshape(T, hv, dv)
        o = gated_rms_norm(o, z, self.norm.weight, eps=self.eps)
        return self.out_proj(o.reshape(T, hv * dv))

    def forward(self, x: torch.Tensor, shard: PackedShard, cache: LayerCapture | None = None) -> torch.Tensor:
        """x [T_local, hidden] (this rank's zigzag shard) -> [T_local, hidden].

        Communicates over ``shard.group`` (the CP group) by ``shard.gated_delta``; every CP rank must call it.
        ``cache`` (a prefill for decoding) receives the final states and conv windows decoding continues
        from: at CP = 1 the core then runs on ``cache.gdn_cu_seqlens`` (each sequence cut before its tail
        pad); at CP > 1 the raw inputs are gathered to the row and the states computed there (see
        :mod:`ringtune.models.cache`), the output still by the CP mode.
        """
        q, k, v, g, beta, conv_weight = self._project(x)
        if shard.cp_size > 1:
            fn = gdn_cp_fn(shard.gated_delta)
            o = fn(q, k, v, g, beta, conv_weight, shard.plan, shard.group, faults=shard.faults)
            if cache is not None:
                cache.record_gated_delta_inputs(q, k, v, g, beta, conv_weight)
        elif cache is None:
            o = gated_delta_core(q, k, v, shard.cu_seqlens, g=g, beta=beta, conv_weight=conv_weight)
        else:
            o, final, window = gated_delta_prefill(
                q, k, v, cache.gdn_cu_seqlens, g=g, beta=beta, conv_weight=conv_weight
            )
            cache.record_gated_delta(final, window)
        return self._output(x, o)

    def decode(self, x: torch.Tensor, rows: GatedDeltaRows) -> torch.Tensor:
        """One new token per sequence: x [B, hidden] -> [B, hidden]; updates ``rows`` (state, conv) in place."""
        q, k, v, g, beta, conv_weight = self._project(x)
        o, rows.conv, rows.state = gated_delta_decode_core(
            q, k, v, g=g, beta=beta, conv_weight=conv_weight, conv_window=rows.conv, state=rows.state
        )
        return self._output(x, o)


class _GatedNormWeight(nn.Module):
    """Holds ``norm.weight`` [head_v_dim] (ones) under the HF name; the norm itself is :func:`gated_rms_norm`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
