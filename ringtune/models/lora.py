"""LoRA adapters on a frozen base :class:`~ringtune.models.decoder.CausalLM`: ``base(x) + scale · B(A(x))``.

A LoRA run's trainable state is a :class:`LoraModel`: its :class:`LoraAdapters` (``lora_A`` [r, in] and
``lora_B`` [out, r] per targeted linear, the only parameters it registers) and a reference to the frozen
base, which is *not* one of its submodules: ``state_dict()``, ``parameters()`` and so DCP checkpoints and
AdamW hold the adapters only, and many runs can hold the same base object.

The base gets one :class:`LoraSlot` (forward hooks on its targeted linears, installed once): each hook adds
``scale · B(A(x))`` of the adapters the slot holds *now* (``slot.active``), nothing when it holds none.
:meth:`LoraModel.forward` makes its adapters the active ones; they stay active until another run's forward,
so a backward that recomputes a layer (``--recompute``) adds the same adapters as its forward did. The
unembedding (``train_unembed``) is adapted through the weight: the log-prob head reads
``W + scale · B @ A`` (:attr:`LoraModel.output_weight`), which gives the logits ``h Wᵀ + scale · (h Aᵀ) Bᵀ``.

Targets (the groups of the SDK's ``LoraConfig``, as hosted Tinker adapts them; the per-rank-1 parameter counts
of ``tinker_cookbook.hyperparam_utils`` match these sets):

- ``train_attn``: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` of full-attention layers; in GatedDeltaNet
  layers ``in_proj_qkv`` as three adapters ``in_proj_q`` / ``in_proj_k`` / ``in_proj_v`` on its row blocks
  (Tinker trains them separately), ``in_proj_z`` and ``out_proj`` (not the gate projections ``in_proj_a/b``);
- ``train_mlp``: ``gate_proj``, ``up_proj``, ``down_proj`` of SwiGLU MLPs; in MoE layers the shared expert's
  three (a SwiGLU) and the routed experts' as hosted Tinker adapts them (its per-rank parameter counts of
  Qwen3-30B-A3B and Qwen3.5-35B-A3B in ``tinker_cookbook.hyperparam_utils`` match): ``experts.gate_proj`` and
  ``experts.up_proj`` with one ``A`` [r, hidden] shared by every expert and a ``B`` [E, I, r] per expert,
  ``experts.down_proj`` with an ``A`` [E, r, I] per expert and one ``B`` [hidden, r] shared (the hidden side
  is shared, the expert side is each expert's); the router and the shared expert's gate are not adapted;
- ``train_unembed``: ``lm_head`` (the output weight, also when tied to the embeddings: the input embedding
  stays the base's).

Initialisation (PEFT's default, used by hosted Tinker): ``A`` Kaiming-uniform with ``a = √5``, i.e.
``U(−1/√in, 1/√in)``, from a generator seeded by ``LoraSpec.seed`` in target order (the same on every rank);
``B = 0``, so a fresh run computes exactly the base. Scale ``alpha / rank`` with ``alpha = 32``.
Under mixed precision the adapters (float32 masters) are cast to the layer's compute dtype at each use.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ringtune.errors import UserInputError
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.attention import Attention
from ringtune.models.layers.gated_deltanet import GatedDeltaNet
from ringtune.models.layers.mlp import SwiGLU
from ringtune.models.layers.moe import Experts, SparseMoE
from ringtune.models.logprob_head import label_logprobs
from ringtune.models.lora_experts import expert_delta
from ringtune.models.lora_types import (
    ATTN_LINEARS,
    GDN_LINEARS,
    GDN_SPLIT_QKV,
    LORA_ALPHA,
    MAX_LORA_RANK,
    MLP_LINEARS,
    UNEMBED,
    LoraSpec,
    Target,
)
from ringtune.models.shard import PackedShard
from ringtune.ops.linear import linear

__all__ = [
    "ATTN_LINEARS",
    "GDN_LINEARS",
    "GDN_SPLIT_QKV",
    "LORA_ALPHA",
    "MAX_LORA_RANK",
    "MLP_LINEARS",
    "UNEMBED",
    "LoraAdapters",
    "LoraModel",
    "LoraSlot",
    "LoraSpec",
    "Target",
    "expert_targets",
    "lora_params_per_rank",
    "lora_slot",
    "lora_targets",
]


def lora_targets(base: CausalLM, spec: LoraSpec) -> list[Target]:
    """Every adapter of ``spec`` on ``base`` in a fixed order (layers, then the unembedding).

    Raises UserInputError for ``train_mlp`` on an MLP of no known kind.
    """
    targets: list[Target] = []

    def linear(path: str, module: nn.Linear) -> None:
        targets.append(Target(path, path, 0, module.out_features, module.in_features))

    for i, layer in enumerate(base.model.layers):
        prefix = f"model.layers.{i}"
        if spec.train_attn and isinstance(getattr(layer, "self_attn", None), Attention):
            for n in ATTN_LINEARS:
                linear(f"{prefix}.self_attn.{n}", getattr(layer.self_attn, n))
        if spec.train_attn and isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
            gdn = layer.linear_attn
            qkv = gdn.in_proj_qkv
            key_dim, value_dim = gdn.num_k_heads * gdn.head_k_dim, gdn.num_v_heads * gdn.head_v_dim
            start = 0
            for n, rows in zip(GDN_SPLIT_QKV, (key_dim, key_dim, value_dim), strict=True):
                module = f"{prefix}.linear_attn.in_proj_qkv"
                targets.append(Target(f"{prefix}.linear_attn.{n}", module, start, rows, qkv.in_features))
                start += rows
            for n in GDN_LINEARS:
                linear(f"{prefix}.linear_attn.{n}", getattr(gdn, n))
        if spec.train_mlp:
            mlp = layer.mlp
            if isinstance(mlp, SwiGLU):
                for n in MLP_LINEARS:
                    linear(f"{prefix}.mlp.{n}", getattr(mlp, n))
            elif isinstance(mlp, SparseMoE):
                targets.extend(expert_targets(f"{prefix}.mlp.experts", mlp.experts))
                if hasattr(mlp, "shared_expert"):
                    for n in MLP_LINEARS:
                        linear(f"{prefix}.mlp.shared_expert.{n}", getattr(mlp.shared_expert, n))
            else:
                kind = type(mlp).__name__
                raise UserInputError(f"lora_config.train_mlp=True: layer {i}'s MLP {kind} cannot be adapted")
    if spec.train_unembed:
        vocab, hidden = base.output_weight.shape
        targets.append(Target(UNEMBED, UNEMBED, 0, vocab, hidden))
    return targets


def expert_targets(module: str, experts: Experts) -> list[Target]:
    """The routed experts' three adapters of one MoE layer (``module``: the path of its ``Experts``)."""
    hidden, inter = experts.down_proj.shape[1], experts.down_proj.shape[2]
    count = experts.num_experts
    return [
        Target(f"{module}.gate_proj", module, 0, inter, hidden, count),
        Target(f"{module}.up_proj", module, inter, inter, hidden, count),
        Target(f"{module}.down_proj", module, 0, hidden, inter, count),
    ]


def lora_params_per_rank(base: CausalLM) -> dict[str, int]:
    """Adapter parameters per unit of rank of each target group (``attn``, ``mlp``, ``unembed``) on ``base``:
    :attr:`Target.params_per_rank` summed over the group's targets (the cookbook's
    ``_LORA_PARAMS_PER_RANK_BY_COMPONENT``); a group LoRA cannot adapt here is left out."""
    out: dict[str, int] = {}
    for group in ("attn", "mlp", "unembed"):
        flags = {f"train_{g}": g == group for g in ("attn", "mlp", "unembed")}
        try:
            targets = lora_targets(base, LoraSpec(rank=1, **flags))
        except UserInputError:
            continue
        out[group] = sum(t.params_per_rank for t in targets)
    return out


def _key(name: str) -> str:
    """A parameter-dict key for a module path (``.`` is not allowed in parameter names)."""
    return name.replace(".", "-")


class LoraAdapters(nn.Module):
    """``lora_A[key]`` [r, in] and ``lora_B[key]`` [out, r] for every :class:`Target` of ``spec`` on ``base``,
    initialised as the module docstring says, in the base's dtype and on its device."""

    def __init__(self, base: CausalLM, spec: LoraSpec) -> None:
        super().__init__()
        self.spec = spec.validate()
        self.scale = spec.scale
        self.targets = lora_targets(base, spec)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        like = base.output_weight
        gen = torch.Generator().manual_seed(spec.seed)
        for t in self.targets:
            a_shape, b_shape = t.shapes(spec.rank)
            a = torch.empty(a_shape, dtype=torch.float64, device="cpu")
            for matrix in a.reshape(-1, spec.rank, t.in_features):  # each expert's A initialised as a linear's
                nn.init.kaiming_uniform_(matrix, a=math.sqrt(5), generator=gen)
            self.lora_A[_key(t.name)] = nn.Parameter(a.to(dtype=like.dtype, device=like.device))
            self.lora_B[_key(t.name)] = nn.Parameter(torch.zeros(b_shape, dtype=like.dtype, device=like.device))
        self.by_module: dict[str, list[Target]] = {}
        for t in self.targets:
            if t.module != UNEMBED:
                self.by_module.setdefault(t.module, []).append(t)

    @property
    def has_experts(self) -> bool:
        """Whether routed experts are adapted (their rows are grouped by expert, not by token: such runs do
        not share a pass or a decode step with other runs)."""
        return any(t.experts for t in self.targets)

    def pair(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        """(A, B) of the adapter called ``name``."""
        return self.lora_A[_key(name)], self.lora_B[_key(name)]

    def named_pairs(self) -> Iterator[tuple[Target, nn.Parameter, nn.Parameter]]:
        for t in self.targets:
            yield (t, *self.pair(t.name))

    def delta_only(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """``scale · B(A(x))`` [..., out] for the adapters on base module ``module`` (a split module: each
        adapter on its row block, concatenated); adapters are cast to ``x``'s dtype (mixed precision computes
        them like the layer)."""
        parts = []
        for t in self.by_module[module]:
            a, b = self.pair(t.name)
            parts.append(linear(linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scale)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def delta(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + scale · B(A(x))`` (:meth:`delta_only`) in ``out``'s dtype."""
        return out + self.delta_only(module, x).to(out.dtype)

    @property
    def unembed(self) -> Target | None:
        """The unembedding's adapter (``train_unembed``), or None."""
        return next((t for t in self.targets if t.module == UNEMBED), None)

    def output_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The base's output weight [vocab, hidden] as these adapters see it: ``weight + scale · B @ A`` with
        ``train_unembed`` (differentiable in A and B), else ``weight`` itself."""
        target = self.unembed
        if target is None:
            return weight
        a, b = self.pair(target.name)
        return weight + (b @ a).to(weight.dtype) * self.scale


class LoraSlot:
    """The forward hooks of one base model: each targeted linear adds the delta of ``active`` (or nothing)."""

    def __init__(self, base: CausalLM) -> None:
        self.active: LoraAdapters | Any = None  # LoraAdapters, or several runs' (models/lora_mixed.MixedAdapters)
        self.hooked: set[str] = set()
        self._modules = dict(base.named_modules())

    def hook(self, module: str) -> None:
        """Install the hook on base module ``module`` once: a forward hook on a linear; on a MoE layer's
        ``Experts`` its ``adapter`` (called on each fused projection's grouped rows)."""
        if module in self.hooked:
            return
        target = self._modules[module]
        if isinstance(target, Experts):

            def adapt(proj: str, x: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
                active = self.active
                if active is None or module not in active.by_module:
                    return out
                return expert_delta(active, module, proj, x, counts, target.first, out)

            target.adapter = adapt
        else:

            def add(_mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
                active = self.active
                if active is None or module not in active.by_module:
                    return out
                return active.delta(module, args[0], out)

            target.register_forward_hook(add)
        self.hooked.add(module)


def lora_slot(base: CausalLM) -> LoraSlot:
    """The base's :class:`LoraSlot`, created (and the base frozen) on first use."""
    slot = getattr(base, "_lora_slot", None)
    if slot is None:
        base.requires_grad_(False)
        slot = LoraSlot(base)
        object.__setattr__(base, "_lora_slot", slot)
    return slot


class AdaptersOnBase:
    """What a LoRA run's model and its sampling snapshot share: ``adapters`` hooked into a ``base``'s slot.

    The subclass (an ``nn.Module``) sets ``base``, ``slot`` and ``adapters``, then calls :meth:`hook_adapters`.
    """

    base: CausalLM
    slot: LoraSlot
    adapters: LoraAdapters

    def hook_adapters(self) -> None:
        """Hook every adapted module of the base into the slot (the slot adds whichever adapters are active)."""
        for module in self.adapters.by_module:
            self.slot.hook(module)

    @property
    def spec(self) -> LoraSpec:
        return self.adapters.spec

    @property
    def model(self) -> nn.Module:
        """The base's ``model.*`` body (layers: recompute and compute dtype are set there, shared by all runs)."""
        return self.base.model

    def activate(self) -> None:
        """Make these adapters the ones the base's hooks add (until another run activates its own)."""
        self.slot.active = self.adapters

    def check_parallel(self, shard: PackedShard) -> None:
        self.base.check_parallel(shard)


class LoraModel(AdaptersOnBase, nn.Module):
    """A LoRA run's model: a frozen, possibly shared ``base`` plus this run's :class:`LoraAdapters`.

    Quacks like a :class:`CausalLM` for the trainer (``config``, ``model`` = the base's body, ``output_weight``,
    ``forward``/``hidden_states`` on a :class:`PackedShard`); its parameters and state dict are the adapters'
    only (keys ``adapters.lora_A.<module path with - for .>``).
    """

    def __init__(self, base: CausalLM, spec: LoraSpec) -> None:
        super().__init__()
        object.__setattr__(self, "base", base)  # not a submodule: not in parameters() / state_dict()
        self.config = base.config
        self.slot = lora_slot(base)
        self.adapters = LoraAdapters(base, spec)
        self.hook_adapters()

    @property
    def unembed(self) -> Target | None:
        return self.adapters.unembed

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the base's output weight, plus ``scale · B @ A`` with ``train_unembed``."""
        return self.adapters.output_weight(self.base.output_weight)

    def hidden_states(self, input_ids: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        """:meth:`CausalLM.hidden_states` with this run's adapters (collective over the shard's CP group)."""
        self.activate()
        return self.base.hidden_states(input_ids, shard)

    def forward(
        self, input_ids: torch.Tensor, shard: PackedShard, targets: torch.Tensor, upstream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`CausalLM.forward` (log-probs of ``targets``) with this run's adapters."""
        hidden = self.hidden_states(input_ids, shard)
        return label_logprobs(hidden, self.output_weight, targets, upstream=upstream)

    def label_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        return self(input_ids, shard, labels)

    def logits(self, input_ids: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        """Full logits [T_local, vocab] (tests only)."""
        return self.hidden_states(input_ids, shard) @ self.output_weight.t()
