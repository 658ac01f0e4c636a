"""Layer gradient probe: one GatedDeltaNet layer, one gated attention layer and one sparse MoE MLP, CP against no CP.

Every rank builds the same layers and the same packed THD row from a seed. The loss is a fixed random
projection of the output on the tokens of the datum that straddles the first contiguous CP split, from
the split on; half the GDN heads decay slowly. So the input gradients before the split, and part of
every parameter gradient, must cross ranks (the state hand-off, the ring's dK/dV, the head all-to-all).
The MoE MLP routes per token (no CP exchange of its own); its CP modes are where the experts live: every
expert on every rank (``replicated``), or split over the CP ranks with tokens dispatched to them and back by
all-to-alls (``expert_parallel``, EP = CP), whose expert gradients are gathered, not summed, for the comparison.
The reference runs the whole row in one process in the same dtype; the CP run gathers the output and
the input gradient back to row order and sums parameter gradients over the CP group.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import nn

from ringtune.errors import ParallelConfigError
from ringtune.layout.zigzag import ZigzagPlan, chunk_len, zigzag_plan
from ringtune.models.layers.attention import Attention
from ringtune.models.layers.gated_deltanet import GatedDeltaNet
from ringtune.models.layers.moe import SparseMoE

# Default sizes: Qwen3.5-4B's GatedDeltaNet (16 key / 32 value heads of 128) and full-attention layer.
QWEN35_4B = {
    "hidden": 2560,
    "gdn_k_heads": 16,
    "gdn_v_heads": 32,
    "gdn_head_dim": 128,
    "attn_heads": 16,
    "attn_kv_heads": 4,
    "attn_head_dim": 256,
}


@dataclass(frozen=True, kw_only=True)
class ProbeSizes:
    """Layer sizes; ``scale`` divides the hidden size and every head dim (head counts stay, so CP fits)."""

    hidden: int = QWEN35_4B["hidden"]
    gdn_k_heads: int = QWEN35_4B["gdn_k_heads"]
    gdn_v_heads: int = QWEN35_4B["gdn_v_heads"]
    gdn_head_dim: int = QWEN35_4B["gdn_head_dim"]
    conv_kernel: int = 4
    attn_heads: int = QWEN35_4B["attn_heads"]
    attn_kv_heads: int = QWEN35_4B["attn_kv_heads"]
    attn_head_dim: int = QWEN35_4B["attn_head_dim"]
    attention_gate: bool = True
    moe_experts: int = 64
    moe_top_k: int = 8
    moe_intermediate: int = 512
    moe_shared: int = 512
    scale: int = 1

    def scaled(self, value: int) -> int:
        if value % self.scale:
            raise ValueError(f"--scale {self.scale} must divide every size; {value} % {self.scale} != 0")
        return value // self.scale


def probe_row(tokens: int, seed: int) -> tuple[int, ...]:
    """A packed row of exactly ``tokens`` tokens shaped like a real batch.

    Short chats (1-3 tokens included, log-normal around tokens/40), one document of about half the row
    in the middle (it straddles the first contiguous split at every CP size), more chats after it.
    """
    if tokens < 64:
        raise ValueError(f"--tokens {tokens} must be >= 64")
    rng = random.Random(seed)
    head = [1, 3, 2]
    while sum(head) < tokens // 5:
        head.append(max(1, int(rng.lognormvariate(math.log(tokens / 40), 0.8))))
    long_doc = tokens // 2
    tail: list[int] = []
    while sum(head) + long_doc + sum(tail) < tokens:
        tail.append(max(1, int(rng.lognormvariate(math.log(tokens / 40), 0.8))))
    lens = [*head, long_doc, *tail]
    excess = sum(lens) - tokens
    while excess > 0:  # trim from the end so the row sums to ``tokens`` exactly
        cut = min(excess, lens[-1] - 1) if lens[-1] > 1 else 0
        if cut == 0:
            excess -= lens.pop()
            continue
        lens[-1] -= cut
        excess -= cut
    return tuple(lens)


def loss_mask(seq_lens: tuple[int, ...], cp: int) -> tuple[torch.Tensor, int, int]:
    """bool [row tokens]: the tokens of the datum straddling the first contiguous split, from the split on.

    Returns ``(mask, datum index, position of the split inside the datum)``. Splits are tried in order
    (``r·local_len`` of the global padded stream, r = 1..C-1); the first that falls inside real tokens wins.
    """
    plan = zigzag_plan(seq_lens, cp_size=cp, cp_rank=0, pad_multiplier=1)
    mask = torch.zeros(sum(seq_lens), dtype=torch.bool, device="cpu")
    for r in range(1, max(cp, 2)):
        boundary = r * plan.local_len if cp > 1 else sum(seq_lens) // 2
        starts = plan.global_starts if cp > 1 else plan.row_starts
        for i, (start, n) in enumerate(zip(starts, seq_lens, strict=True)):
            if start < boundary < start + n:
                split = boundary - start
                row_start = plan.row_starts[i]
                mask[row_start + split : row_start + n] = True
                return mask, i, split
    raise ValueError(f"no datum of the row straddles a contiguous split at CP={cp}; use more --tokens")


def build_layers(sizes: ProbeSizes, *, dtype: torch.dtype, seed: int, sharpness: float | None) -> dict[str, nn.Module]:
    """The probe layers (``gdn``, ``attention``, ``moe``), seeded (identical on every rank), cast to ``dtype``.

    GDN: half the value heads decay slowly (A = exp(A_log) = 1e-3: ~e^-1.3 over 1000 tokens), the other half
    as transformers initialises them. Attention: zero-centred q/k RMSNorm, output gate unless disabled, no
    rotary, no bias; ``sharpness`` sets the q/k norm gains to sqrt(sharpness), so logits have std ≈ sharpness.
    """
    torch.manual_seed(seed)
    s = sizes.scaled
    gdn = GatedDeltaNet(
        hidden_size=s(sizes.hidden),
        num_k_heads=sizes.gdn_k_heads,
        num_v_heads=sizes.gdn_v_heads,
        head_k_dim=s(sizes.gdn_head_dim),
        head_v_dim=s(sizes.gdn_head_dim),
        conv_kernel=sizes.conv_kernel,
    )
    with torch.no_grad():
        gdn.A_log[: sizes.gdn_v_heads // 2] = math.log(1e-3)
        gdn.norm.weight.uniform_(0.5, 1.5)
    attention = Attention(
        hidden_size=s(sizes.hidden),
        num_heads=sizes.attn_heads,
        num_kv_heads=sizes.attn_kv_heads,
        head_dim=s(sizes.attn_head_dim),
        qk_norm="zero_centered",
        output_gate=sizes.attention_gate,
    )
    with torch.no_grad():
        gain = math.sqrt(sharpness) - 1.0 if sharpness is not None else 0.0
        for norm in (attention.q_norm, attention.k_norm):
            norm.weight.fill_(gain).add_(0.02 * torch.randn_like(norm.weight))
    moe = ProbeMoE(
        SparseMoE(
            s(sizes.hidden),
            s(sizes.moe_intermediate),
            sizes.moe_experts,
            sizes.moe_top_k,
            norm_topk_prob=True,
            shared_intermediate_size=s(sizes.moe_shared),
        )
    )
    with torch.no_grad():
        moe.mlp.gate.weight.normal_(0.0, 0.5)  # routing that differs per token
    return {"gdn": gdn.to(dtype), "attention": attention.to(dtype), "moe": moe.to(dtype)}


MOE_MODES = ("replicated", "expert_parallel")
"""Where the probe's MoE experts live under CP: on every rank, or split over the CP ranks (EP = CP)."""


class ProbeMoE(nn.Module):
    """The probe's MoE MLP with the probe's layer interface: ``forward(x, shard)`` and ``check_cp(cp, mode)``."""

    def __init__(self, mlp: SparseMoE) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor, shard) -> torch.Tensor:
        return self.mlp(x, None, shard.plan.is_real.to(x.device))

    def check_cp(self, cp: int, mode: str) -> None:
        """ParallelConfigError unless ``mode`` is a MoE mode and (expert_parallel) CP divides the experts."""
        if mode not in MOE_MODES:
            raise ParallelConfigError(f"MoE probe mode {mode!r}: choose one of {MOE_MODES}")
        if mode == "expert_parallel" and self.mlp.experts.num_experts % cp:
            raise ParallelConfigError(f"expert_parallel needs CP={cp} to divide {self.mlp.experts.num_experts} experts")


def probe_inputs(tokens: int, hidden: int, *, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-order inputs ``x`` [T, hidden] (unit scale, like normed hidden states) and loss weights, seeded."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen, device="cpu")
    w = torch.randn(tokens, hidden, generator=gen, device="cpu") / math.sqrt(hidden)
    return x.to(dtype), w.to(dtype)


def logit_std(attention: Attention, x: torch.Tensor, samples: int = 256) -> float:
    """Std of the attention logits q·k·scale of head 0 over the first ``samples`` tokens (all pairs)."""
    with torch.no_grad():
        x = x[:samples]
        T = x.shape[0]
        q = attention.q_proj(x).view(T, attention.num_heads, -1)[..., : attention.head_dim]
        k = attention.k_proj(x).view(T, attention.num_kv_heads, attention.head_dim)
        q, k = attention.q_norm(q), attention.k_norm(k)
        return float(((q[:, 0].double() @ k[:, 0].double().T) * attention.scale).std())


def row_order(local: torch.Tensor, plans: list[ZigzagPlan], parts: list[torch.Tensor]) -> torch.Tensor:
    """Real rows of every rank's shard ``parts[r]`` [local_len, ...] scattered to row order [row tokens, ...]."""
    rows = local.new_zeros((sum(plans[0].seq_lens), *local.shape[1:]))
    for plan, part in zip(plans, parts, strict=True):
        real = plan.is_real
        rows[plan.row_index[real]] = part[real]
    return rows


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors as flat float64 vectors (1.0 when both are zero)."""
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b) / max(na * nb, 1e-300)


def norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a| / |b| in float64 (1.0 when both are zero)."""
    na, nb = float(a.double().norm()), float(b.double().norm())
    return 1.0 if na == nb == 0 else na / max(nb, 1e-300)


def low_rows(
    cp_rows: torch.Tensor, ref_rows: torch.Tensor, seq_lens: tuple[int, ...], cp: int, *, below: float = 0.99
) -> tuple[dict[tuple[int, int], int], int]:
    """Rows (tokens) whose cosine with the reference is below ``below``, counted per (datum, zigzag chunk).

    Rows whose reference norm is under 1e-6 of the largest row norm are numerical dust and not compared
    (e.g. the input gradient of datums the loss never sees is exactly 0 in both). Returns the counts and
    the number of rows compared.
    """
    a, b = cp_rows.double().flatten(1), ref_rows.double().flatten(1)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    compared = nb > 1e-6 * float(nb.max()) if nb.numel() else nb.bool()
    cos = (a * b).sum(1) / (na * nb).clamp_min(1e-300)
    bad = compared & (cos < below)
    counts: dict[tuple[int, int], int] = {}
    start = 0
    for i, n in enumerate(seq_lens):
        c = chunk_len(n, cp)
        for p in torch.nonzero(bad[start : start + n]).flatten().tolist():
            key = (i, p // c)
            counts[key] = counts.get(key, 0) + 1
        start += n
    return counts, int(compared.sum())
