"""Full causal attention over a packed shard: Llama/Qwen3 attention and Qwen3.5's gated attention.

One module covers the three target families by flags: q/k RMSNorm on the head dim (Qwen3: plain
weights; Qwen3.5: zero-centred), an output gate (Qwen3.5: ``q_proj`` emits ``[q | gate]`` per head and
the attention output is multiplied by ``sigmoid(gate)``), partial rotary (Qwen3.5) and projection bias.
Under CP the token mixing is the CP attention variant named by the shard (ring, all-gather, all-to-all)
over the shard's CP group; everything else is per token.
"""

from __future__ import annotations

import torch
from torch import nn

from ringtune.models.batch_cache import KVRows
from ringtune.models.cache import LayerCapture
from ringtune.models.layers.norms import RMSNorm
from ringtune.models.layers.rotary import RotaryEmbedding, apply_rotary
from ringtune.models.shard import PackedShard
from ringtune.ops.attention import check_ulysses_heads, cp_attention_fn
from ringtune.ops.attention.decode import decode_attention
from ringtune.ops.linear import Linear


class Attention(nn.Module):
    """Causal self-attention, HF names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``/``k_norm``).

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: shapes (GQA: ``num_heads % num_kv_heads == 0``).
        qk_norm: None, "plain" (Qwen3) or "zero_centered" (Qwen3.5).
        output_gate: Qwen3.5's sigmoid output gate (doubles ``q_proj``'s output, per head ``[q | gate]``).
        bias: bias on q/k/v/o projections (``attention_bias``).
        rotary: the model's :class:`RotaryEmbedding`, or None for no rotary (e.g. the layer probe).
        scale: softmax scale, default ``head_dim ** -0.5``.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: str | None = None,
        output_gate: bool = False,
        bias: bool = False,
        rms_norm_eps: float = 1e-6,
        rotary: RotaryEmbedding | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if qk_norm not in (None, "plain", "zero_centered"):
            raise ValueError(f"qk_norm must be None, 'plain' or 'zero_centered'; got {qk_norm!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        if qk_norm is not None:
            zero = qk_norm == "zero_centered"
            self.q_norm: RMSNorm | None = RMSNorm(head_dim, eps=rms_norm_eps, zero_centered=zero)
            self.k_norm: RMSNorm | None = RMSNorm(head_dim, eps=rms_norm_eps, zero_centered=zero)
        else:
            self.q_norm = self.k_norm = None
        # Not a submodule: the model owns the rotary tables, shared by every layer.
        self._rotary = [rotary] if rotary is not None else []

    def check_cp(self, cp_size: int, mode: str) -> None:
        """Raise ParallelConfigError if this layer's heads do not fit CP ``mode`` at ``cp_size``."""
        if mode == "alltoall":
            check_ulysses_heads(self.num_heads, self.num_kv_heads, cp_size)

    def _project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, hidden], positions int64 [T] (or MRoPE [3, T]) -> q [T, Hq, D], k, v [T, Hkv, D] (normed,
        rotated), gate or None."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, -1)
        gate = None
        if self.output_gate:
            q, gate = q.split(self.head_dim, dim=-1)
            gate = gate.reshape(T, self.num_heads * self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if self._rotary:
            cos, sin = self._rotary[0](positions, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v, gate

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention output [T, Hq, D] -> [T, hidden] (output gate, then ``o_proj``)."""
        out = out.reshape(out.shape[0], self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def forward(self, x: torch.Tensor, shard: PackedShard, cache: LayerCapture | None = None) -> torch.Tensor:
        """x [T_local, hidden] (this rank's zigzag shard) -> [T_local, hidden].

        Communicates over ``shard.group`` (the CP group) by ``shard.attention``; every CP rank must call it.
        ``cache`` (a prefill for decoding) receives the keys and values decoding continues from (gathered
        over the CP group at CP > 1).
        """
        if shard.mrope_positions is not None:  # a row with images: (t, h, w) positions, built per whole sequence
            positions = shard.mrope_positions
        else:
            positions = shard.faults.shift_positions(shard.positions)  # DEBUG-FAULT HOOK (parity negative control)
        q, k, v, gate = self._project(x, positions)
        mode = shard.attention if shard.cp_size > 1 else "ring"  # the ring at size 1 is the local kernel
        out, _ = cp_attention_fn(mode)(
            q.contiguous(), k.contiguous(), v, shard.plan, shard.group, scale=self.scale, faults=shard.faults
        )
        if cache is not None:
            cache.record_attention(k, v)
        return self._output(out, gate)

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, rows: KVRows, rotary_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One new token per sequence: x [B, hidden] at ``positions`` int64 [B] -> [B, hidden].

        Writes the tokens' keys/values into slot ``positions[b]`` of ``rows`` (capacity must exceed it) and
        attends over slots ``[0, positions[b]]`` of each row. ``rotary_positions`` int64 [B]: the rotary
        position of each token when it is not its slot (a sequence after images continues its MRoPE count,
        :mod:`ringtune.layout.mrope`); None: the slot. No communication.
        """
        q, k, v, gate = self._project(x, positions if rotary_positions is None else rotary_positions)
        rows.write(k, v, positions)
        out = decode_attention(q, rows.k, rows.v, positions + 1, scale=self.scale)
        return self._output(out, gate)
