"""Activation recomputation per decoder layer: one knob, three modes, chosen here and nowhere else.

- ``none``: autograd keeps every intermediate of every layer until the backward.
- ``full``: each layer keeps only its input [T_local, hidden]; the backward reruns the layer's forward
  (its CP collectives included) just before the layer's own backward.
- ``selective``: keep what is expensive to recompute, recompute the rest. Attention layers keep their
  attention core (the CP attention op saves its q/k/v, output and log-sum-exp, and its ring / all-gather /
  all-to-all is not rerun) and recompute the norm, projections, rotary, output gate, ``o_proj`` and the MLP.
  GatedDeltaNet layers are recomputed whole, as in ``full``: they are linear in tokens and what they keep
  (conv, norms, projections and the chunked scan's inputs, ~15× the hidden state per token on the benchmark
  model; the scan itself recomputes its [C, C] intermediates in its backward) is what long rows cannot keep;
  their CP all-to-alls (headwise) or relayouts, halo shift and summary all-gather (chunkwise) run again in
  the backward.

Recomputation uses ``torch.utils.checkpoint`` with ``use_reentrant=False`` and ``early_stop=False``: the
rerun executes the whole recorded function, so every rank reruns the same collectives in the same order
(a layer's forward is deterministic and rank-independent in its sequence of collectives), and it runs at
the same point of every rank's backward: when the first node of the layer's backward executes, which the
engine reaches only after the gradient of the layer's output is complete, i.e. after every backward
collective of the layers above. The rerun computes the same values from the same inputs with the same
ops, so the saved tensors it produces are bit-identical to the first forward's; gradients equal those
of ``none`` up to the order in which autograd sums the contributions of a tensor read twice (selective
splits an attention layer at the attention core), far below 1e-12 in float64 (``tests/test_recompute.py``).

The mode is an attribute of each :class:`~ringtune.models.decoder.DecoderLayer` (``layer.recompute``),
set for a whole model by :func:`set_recompute` (``Trainer(recompute=...)`` calls it). It is applied inside
the layer's ``forward``, so FSDP2's per-layer hooks (``Trainer(shard_params=True)``) wrap the recomputed
region as torchtitan's activation checkpointing does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringtune.errors import UserInputError
from ringtune.models.precision import layer_params, layer_round
from ringtune.ops.attention import cp_attention_fn

if TYPE_CHECKING:
    from ringtune.models.shard import PackedShard

RECOMPUTE_MODES: tuple[str, ...] = ("none", "full", "selective")
"""Activation recomputation modes; the first is the default."""

DEFAULT_RECOMPUTE = RECOMPUTE_MODES[0]


def check_recompute_mode(mode: object, field: str = "recompute") -> str:
    """``mode`` if it is a recomputation mode name, else UserInputError naming ``field`` and the choices."""
    if not isinstance(mode, str) or mode not in RECOMPUTE_MODES:
        raise UserInputError(f"{field}={mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def set_recompute(model: nn.Module, mode: str) -> None:
    """Set the recomputation ``mode`` of every decoder layer of ``model`` (a ``CausalLM``, possibly FSDP-wrapped)."""
    check_recompute_mode(mode)
    for layer in model.model.layers:
        layer.recompute = mode


def recomputed(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``fn(*args)`` keeping only ``args``; the backward reruns all of ``fn`` (its collectives included)."""
    return checkpoint(fn, *args, use_reentrant=False, early_stop=False)


def run_decoder_layer(layer: nn.Module, x: torch.Tensor, shard: PackedShard, mode: str) -> torch.Tensor:
    """One decoder layer's forward under recomputation ``mode``; same contract as ``DecoderLayer.forward``.

    ``layer.layer_forward(x, shard)`` is the plain forward. x [T_local, hidden] (this rank's zigzag shard)
    -> [T_local, hidden]; collective over the shard's CP group, in forward and backward, on every rank.
    Without autograd (no grad mode, or nothing requires grad) every mode is the plain forward.
    """
    if mode == "none" or not torch.is_grad_enabled():
        return layer.layer_forward(x, shard)
    if mode == "full" or layer.layer_type == "linear_attention":
        return recomputed(layer.layer_forward, x, shard)
    if mode == "selective":
        return _selective_attention_layer(layer, x, shard)
    raise UserInputError(f"recompute={mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")


def _selective_attention_layer(layer: nn.Module, x: torch.Tensor, shard: PackedShard) -> torch.Tensor:
    """``DecoderLayer.layer_forward`` of an attention layer with only the attention core kept.

    The same ops as ``Attention.forward`` (project, CP attention, output) and the residual MLP, split at
    the attention core: the parts before (norm, projections, q/k norm, rotary) and after (output gate,
    ``o_proj``, residual, norm, MLP) are recomputed and talk over no group.
    """
    attn = layer.self_attn
    runs: list[bool] = []  # one entry per call of project: the second is the backward's rerun

    def project(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with layer_params(layer):
            positions = shard.faults.shift_positions(shard.positions)  # DEBUG-FAULT HOOK (as Attention.forward)
            positions = shard.faults.rerun_positions(positions, rerun=bool(runs))  # DEBUG-FAULT HOOK (no-op)
            runs.append(True)
            q, k, v, gate = attn._project(layer.input_layernorm(x), positions)
        return q.contiguous(), k.contiguous(), v, gate

    def finish(x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        with layer_params(layer):
            x = layer_round(layer, x + attn._output(out, gate))
            return layer_round(layer, x + layer.mlp_out(layer.post_attention_layernorm(x), shard))

    q, k, v, gate = checkpoint(project, x, use_reentrant=False, early_stop=False)
    mode = shard.attention if shard.cp_size > 1 else "ring"  # as Attention.forward: the ring at size 1 is local
    out, _ = cp_attention_fn(mode)(q, k, v, shard.plan, shard.group, scale=attn.scale, faults=shard.faults)
    return checkpoint(finish, x, out, gate, use_reentrant=False, early_stop=False)
