"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen3.5-MoE, with transformers' module and parameter names.

``mlp.gate.weight`` [E, hidden] (the router), ``mlp.experts.gate_up_proj`` [E_local, 2·I, hidden] and
``mlp.experts.down_proj`` [E_local, hidden, I] (transformers 5's fused 3-D expert tensors), and for Qwen3.5-MoE
``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate`` [1, hidden].

Per token t (x [T, hidden], routing per token, so CP needs no communication here):
``p = softmax(x W_gate^T)`` in float32 (float64 for a float64 model), the top-k experts by ``p`` (or the ids of
``replay`` with their ``p`` recomputed), weights ``p_top`` (divided by their sum when ``norm_topk_prob``);
``y = Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))`` [+ ``sigmoid(x w_sg) · shared(x)``].

Expert parallelism: with :func:`set_expert_parallel` each rank of the EP group keeps experts
``[r·E/N, (r+1)·E/N)`` only; the tokens routed to others go there and back by
:func:`ringtune.parallel.expert_dispatch.routed_experts_ep` (all-to-alls of uneven sizes, differentiable).
Every rank of the EP group must then run each MoE layer's forward (and backward) together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtune.errors import ParallelConfigError, UserInputError
from ringtune.models.layers.mlp import SwiGLU
from ringtune.models.layers.moe_router_stats import RouterStats, record
from ringtune.models.layers.silu_mul import silu_mul
from ringtune.ops.linear import Linear, linear
from ringtune.parallel.expert_dispatch import routed_experts_ep

GroupedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [n, in], w [G, out, in], counts int64 [G] summing to n; rows grouped by g in order) -> [n, out]."""


def grouped_linear_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The plain reference: one ``x_g @ w_g^T`` per group (skipping empty groups), each by
    :func:`ringtune.ops.linear.linear` (the registry's kernel: oneDNN for float32 on a CPU, aten otherwise).

    With no rows at all the result is still ``x @ w_0^T`` (an empty [0, out] tensor *in the graph*): under EP a
    rank that received no tokens must still run the backward of the all-to-all that brought them (its peers
    run theirs), which autograd only does if that all-to-all's output reaches the loss."""
    outs = [linear(xg, w[g]) for g, xg in enumerate(x.split(counts.tolist())) if xg.shape[0]]
    return torch.cat(outs) if outs else linear(x, w[0])


def grouped_linear_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (``torch._grouped_mm``, one kernel for every group)."""
    offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


GROUPED_LINEAR: dict[str, GroupedLinear] = {"loop": grouped_linear_loop, "grouped_mm": grouped_linear_mm}
"""Grouped expert matmul implementations; :func:`grouped_linear_kind` picks one per call."""


def grouped_linear_kind(x: torch.Tensor, w: torch.Tensor) -> str:
    """``grouped_mm`` where the build has it and it is usable (CUDA, float32/bfloat16/float16, 16-byte-aligned
    rows), else ``loop``. On CPU torch 2.13's ``_grouped_mm`` runs forward but its backward fails, so CPU loops.
    """
    ok_dtype = x.dtype in (torch.float32, torch.bfloat16, torch.float16) and w.dtype == x.dtype
    aligned = all(d * x.element_size() % 16 == 0 for d in w.shape[1:])
    if hasattr(torch, "_grouped_mm") and x.is_cuda and ok_dtype and aligned:
        return "grouped_mm"
    return "loop"


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` [n, in] grouped by ``counts`` [G] -> [n, out] through the implementation the registry picks."""
    return GROUPED_LINEAR[grouped_linear_kind(x, w)](x, w, counts)


class TopKRouter(nn.Module):
    """``mlp.gate``: the router, ``weight`` [num_experts, hidden]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, *, with_probs: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids int64 [T, k]).

        ``replay`` (int64 [T, k]): use these ids instead of the top-k, their weights recomputed from this
        router's own probabilities (so the router still gets gradients); a row of −1 keeps the router's own
        top-k for that token. ``with_probs``: the softmax probabilities [T, num_experts] (float32 or wider,
        differentiable) come third.
        """
        logits = F.linear(x, self.weight)  # aten, bit for bit with transformers' router: a top-k flips on a last bit
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if replay is not None:
            replay = replay.to(device=x.device, dtype=torch.int64)
            ids = torch.where(replay >= 0, replay, ids)  # rows are all ids or all -1 (check_replay)
            top = probs.gather(1, ids)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype), ids, probs) if with_probs else (top.to(logits.dtype), ids)


class Experts(nn.Module):
    """``mlp.experts``: this rank's experts ``[first, first + E_local)`` as fused 3-D tensors."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.first = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)  # as transformers' _init_weights (initializer_range 0.02)
        # LoRA on the routed experts (models/lora.py LoraSlot): (proj, x, counts, out) -> out + the adapters'
        # delta, called on each fused projection's rows; None: no adapters
        self.adapter: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def keep(self, first: int, count: int) -> None:
        """Keep only experts ``[first, first + count)`` (a copy of that slice: the others' memory is freed; on the
        meta device, the shapes only)."""
        self.first = first
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(self, name)
            piece = full.detach()[first : first + count].clone()
            setattr(self, name, nn.Parameter(piece, requires_grad=full.requires_grad))

    @property
    def num_local(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] grouped by local expert (``counts`` int64 [E_local]) -> [n, hidden]."""
        gate_up = grouped_linear(x, self.gate_up_proj, counts)
        if self.adapter is not None:
            gate_up = self.adapter("gate_up_proj", x, counts, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = silu_mul(gate, up)
        out = grouped_linear(hidden, self.down_proj, counts)
        if self.adapter is not None:
            out = self.adapter("down_proj", hidden, counts, out)
        return out


def routed_experts_local(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """``Σ_k weights[t, k] · expert_{ids[t, k]}(x[t])`` [T, hidden] with every expert here (one grouped pass).

    The (token, slot) copies are sorted by expert (stable: each expert sees its tokens in row order), run
    through the grouped matmuls, scaled by their weights and added back per token.
    """
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=experts.num_experts)
    routed = experts(x[token_of], counts) * weights.reshape(-1)[order, None]
    return x.new_zeros(x.shape).index_add(0, token_of, routed)


class SparseMoE(nn.Module):
    """``mlp`` of a MoE layer: router, routed experts, optional sigmoid-gated shared expert.

    ``ep_group`` (None: every expert here) is set by :func:`set_expert_parallel`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        if shared_intermediate_size:
            self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.ep_group: dist.ProcessGroup | None = None
        self.track_probs = False  # record the router probabilities for the aux loss (moe_router_stats)
        self.router_stats: RouterStats | None = None  # the last forward's (real tokens only)
        self.captured: list[torch.Tensor] | None = None  # each forward's expert ids, while capturing_routing

    def check_replay(self, replay: torch.Tensor, tokens: int) -> None:
        """Raise UserInputError unless ``replay`` is int [tokens, top_k], each row k expert ids in
        [0, num_experts) or k times −1 (the router chooses for that token)."""
        k, n = self.gate.top_k, self.experts.num_experts
        if replay.shape != (tokens, k) or replay.is_floating_point():
            raise UserInputError(f"replay_experts must be int [{tokens}, top_k={k}]; got {tuple(replay.shape)}")
        if not replay.numel():
            return
        partial = (replay < 0).any(-1) & (replay >= 0).any(-1)
        if int(replay.min()) < -1 or int(replay.max()) >= n or bool(partial.any()):
            raise UserInputError(
                f"replay_experts ids must be in [0, num_experts={n}) (or a row of -1); got "
                f"[{int(replay.min())}, {int(replay.max())}]"
            )

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``replay`` int64 [T, top_k] or None (see :class:`TopKRouter`); ``valid``
        bool [T] marks the real tokens (None: all) for ``router_stats``."""
        if replay is not None:
            self.check_replay(replay, x.shape[0])
        weights, ids, probs = self.gate(x, replay, with_probs=True)
        self.router_stats = record(probs if self.track_probs else None, ids.detach(), valid, self.experts.num_experts)
        if self.captured is not None:
            self.captured.append(ids.detach())
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            out = routed_experts_ep(x, ids, weights, self.experts, self.ep_group)
        else:
            out = routed_experts_local(x, ids, weights, self.experts)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    """Every :class:`SparseMoE` of ``model``, in module order (of its ``base`` for a LoRA model, whose frozen base
    is not a submodule)."""
    base = getattr(model, "base", None)
    root = base if isinstance(base, nn.Module) else model
    return [m for m in root.modules() if isinstance(m, SparseMoE)]


def named_moe_blocks(model: nn.Module) -> list[tuple[str, SparseMoE]]:
    """Every :class:`SparseMoE` submodule of ``model`` with its module path, in module order (a LoRA model's
    frozen base is not a submodule: none of its blocks)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoE)]


@contextmanager
def capturing_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """While active, each MoE block of ``model`` appends every forward's expert ids (int64 [T, k], detached) to
    its own list; yields the lists, in layer order (the sampler records routing for replay this way)."""
    blocks = moe_blocks(model)
    lists: list[list[torch.Tensor]] = [[] for _ in blocks]
    for block, ids in zip(blocks, lists, strict=True):
        block.captured = ids
    try:
        yield lists
    finally:
        for block in blocks:
            block.captured = None


def moe_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, experts) of ``model``, the shape of a routing record per token; None
    for a dense model. Every MoE layer of the served families has the same k and number of experts."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    return len(blocks), blocks[0].gate.top_k, blocks[0].experts.num_experts


def is_expert_parameter(name: str) -> bool:
    """Whether parameter ``name`` is a routed expert's (sharded over EP, replicated over (DP·CP)/EP ranks)."""
    return name.split(".")[-2:] in (["experts", "gate_up_proj"], ["experts", "down_proj"])


def set_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Keep only this rank's experts in every MoE layer and route tokens over ``group`` (the EP group).

    Rank r of an EP group of size N keeps experts ``[r·E/N, (r+1)·E/N)`` (a copy of that slice: the other
    experts' memory is freed). None or size 1: nothing changes. Call it on the full model before training, or
    on one loaded with this rank's experts only (:func:`ringtune.models.checkpoints.hf.load_hf` ``ep=``);
    calling it again on a model already sharded over an equal-sized group only swaps the group (after
    :func:`ringtune.parallel.mesh.rebuild_mesh`). Raises ParallelConfigError when N does not divide num_experts.
    """
    size = 1 if group is None else dist.get_world_size(group)
    blocks = moe_blocks(model)
    if size == 1 or not blocks:
        return
    rank = dist.get_rank(group)
    for block in blocks:
        experts = block.experts
        if experts.num_local * size == experts.num_experts and experts.first == rank * experts.num_local:
            block.ep_group = group  # already this rank's experts: loaded so, or a rebuilt group
            continue
        if experts.num_local != experts.num_experts:
            raise ParallelConfigError(
                f"set_expert_parallel: experts already sharded ({experts.num_local} of {experts.num_experts} here)"
            )
        if experts.num_experts % size:
            raise ParallelConfigError(f"ep={size} must divide num_experts={experts.num_experts}")
        local = experts.num_experts // size
        experts.keep(rank * local, local)
        block.ep_group = group


def gather_expert_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` (default ``model.state_dict()``) with every MoE layer's experts whole, on every EP rank.

    Collective over each expert-parallel block's ``ep_group`` (all EP ranks call it together); the expert
    shards are equal-sized, so one all-gather per tensor puts them back in expert order.
    """
    state = dict(model.state_dict() if state is None else state)
    for name, module in model.named_modules():
        if not isinstance(module, SparseMoE) or module.ep_group is None:
            continue
        group = module.ep_group
        for proj in ("gate_up_proj", "down_proj"):
            key = f"{name}.experts.{proj}"
            local = state[key].detach().contiguous()
            pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, local, group=group)
            state[key] = torch.cat(pieces)
    return state
