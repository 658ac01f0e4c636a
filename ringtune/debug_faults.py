"""Debug faults: deliberate, *silent* CP bugs that the negative controls must catch, as one hook object.

A fault is carried as a frozen :class:`FaultHooks` (default :data:`NO_FAULTS`, every hook the identity) that
production code receives explicitly: the trainer builds one per microbatch from ``--debug-fault NAME`` and puts
it on the :class:`~ringtune.models.shard.PackedShard` (``shard.faults``); the model's layers hand
``shard.faults`` to the ops they call (ring attention, chunkwise GatedDeltaNet) and read
``shard.faults.shift_positions`` before rotary; the engine calls the hooks of its own object. There is no
global state: code that is not given a fault never sees one. Each hook call in production code is one line
marked ``# DEBUG-FAULT HOOK``.

Served faults (:data:`DEBUG_FAULTS`: ``ringtune serve --debug-fault NAME``, hidden flag; ``ringtune parity
matrix --faults`` serves each and ``ringtune parity compare`` must fail it):

=================================  ===========================================================================
``position_off_by_one``            rotary reads positions + 1 for the tokens of zigzag chunk ``C`` of every
                                   sequence (the first chunk of the last CP rank's second half), after
                                   ``PackedShard`` checked the positions against the plan
``gradients_averaged``             the DP×CP-summed gradients are divided by the group size *after* the
                                   gradient invariant passed (a plain average would trip the invariant)
``gdn_state_dropped``              chunkwise GatedDeltaNet: the incoming state handed across a contiguous split
                                   is replaced by zeros (the conv halo still crosses)
``loss_sign_flipped``              the last CP rank's per-token loss terms are negated (their gathered
                                   loss flips; the gradient of that rank's tokens points the wrong way)
``weight_decay_skipped_cp1``       AdamW on CP rank 1 runs with weight decay 0: its replica drifts from the
                                   others after the first step with weight decay (every figure read from rank 0
                                   stays clean; the replica check sees it)
``unscored_backward_skipped``      a CP rank whose share of a microbatch holds no scored token (target pad or
                                   weight 0) drops the parameter gradients of its backward (it still runs the
                                   collectives, so nothing hangs): the gradient its tokens get through the
                                   later tokens of other ranks is lost
``gdn_decay_relayout_bf16``        chunkwise GatedDeltaNet: the log decay ``g`` is moved zigzag -> contiguous
                                   in the input dtype (rounded to bfloat16) instead of float32
``ring_dkv_exchange_bf16``         ring attention backward: the partial dK/dV is rounded to the input dtype at
                                   every hop instead of travelling in the float32 accumulator
``ring_shift_reversed``            ring attention takes the K/V held at step i as rank ``r + i``'s instead of
                                   ``r - i``'s (the blocks and causal masks of the wrong source): identical at
                                   CP=2 (a ring of two has one neighbour), wrong from CP=4
``allgather_kv_rank_reversed``     all-gather attention: the gathered K/V rank blocks are taken in reverse
                                   rank order before the relayout to the global stream (attention scheme)
``mixed_cast_detached_last_cp``    bf16-mixed: on the last CP rank the layers' bfloat16 casts of the float32
                                   masters are detached, so that rank's share of the layer gradients never
                                   reaches the masters (the forward is unchanged; mixed precision only)
``sharded_step_count_cp1``         FSDP (``--shard-params dp`` / ``dp_cp``): CP rank 1 counts every AdamW step
                                   twice (its ``step`` state, hence its bias correction, runs ahead); only the
                                   replica check of the unsharded step counts sees it under ``dp_cp``
``lora_grads_doubled_last_cp``     a LoRA run: the last CP rank adds its adapter gradients twice per
                                   microbatch (full fine-tuning is untouched)
``recompute_rerun_shifted``        ``--recompute selective``: the attention projections rerun in the backward
                                   read positions + 1 (the forward's log-probs are right, the gradients not)
``long_row_positions_carried``     a packed row of more than :data:`LONG_ROW_SEQUENCES` datums: rotary reads
                                   positions + 1 on each rank's second zigzag chunk of every datum after that
                                   many (rows of few datums are right)
=================================  ===========================================================================

Failure injection (the all-or-nothing tests): :attr:`FaultHooks.before_microbatch`, a callable the trainer
calls with each microbatch's index before running it (it raises, or kills the process, on the rank it chooses).

Unit-test faults (:data:`TEST_FAULTS`, the same hooks; the op, engine and sharding tests inject them through
``Trainer(fault=NAME)`` or straight into the op):

=================================  ===========================================================================
``gdn_halo_dropped``               chunkwise GatedDeltaNet: the conv halo is replaced by zeros
``average_over_group``             the gradient reduction divides by the DP×CP group size (the invariant
                                   must fail)
``scale_by_microbatches``          the loss is divided by the microbatch count (the invariant must fail)
``fsdp_default_divide``            FSDP2 keeps its default mean reduction (:mod:`ringtune.engine.sharding`;
                                   the start-up probe must fail)
``experts_over_dp_cp``             expert gradients are reduced over DP×CP instead of their replica group
=================================  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

DEBUG_FAULTS = (
    "position_off_by_one",
    "gradients_averaged",
    "gdn_state_dropped",
    "loss_sign_flipped",
    "weight_decay_skipped_cp1",
    "unscored_backward_skipped",
    "gdn_decay_relayout_bf16",
    "ring_dkv_exchange_bf16",
    "ring_shift_reversed",
    "allgather_kv_rank_reversed",
    "mixed_cast_detached_last_cp",
    "sharded_step_count_cp1",
    "lora_grads_doubled_last_cp",
    "recompute_rerun_shifted",
    "long_row_positions_carried",
)
"""Every fault name ``--debug-fault`` accepts (the parity negative controls)."""

TEST_FAULTS = (
    "gdn_halo_dropped",
    "average_over_group",
    "scale_by_microbatches",
    "fsdp_default_divide",
    "experts_over_dp_cp",
)
"""Faults only the unit tests inject (each op test's negative control)."""

ALL_FAULTS = DEBUG_FAULTS + TEST_FAULTS
LONG_ROW_SEQUENCES = 32
"""``long_row_positions_carried`` acts on rows of more datums than this (the parity client's default requests pack
at most ~22 per row; its long-row profile packs rows of 48)."""


class RowLayout(Protocol):
    """What :func:`fault_hooks` reads of a row's plan (a :class:`~ringtune.layout.zigzag.ZigzagPlan`)."""

    @property
    def local_starts(self) -> tuple[int, ...]: ...

    @property
    def chunk_lens(self) -> tuple[int, ...]: ...


def check_fault(name: str | None) -> str | None:
    """``name`` if it is None or in :data:`ALL_FAULTS`; ValueError naming the choices otherwise."""
    if name is not None and name not in ALL_FAULTS:
        raise ValueError(f"debug fault {name!r} unknown; choose one of {ALL_FAULTS}")
    return name


@dataclass(frozen=True, kw_only=True)
class FaultHooks:
    """The fault one call injects (``name``; None: none) and this rank's place in the CP group and the row.

    Attributes:
        name: one of :data:`ALL_FAULTS`, or None (every hook is the identity).
        cp_size, cp_rank: this rank's CP group size and rank.
        local_starts, chunk_lens: the row's plan (``ZigzagPlan.local_starts`` / ``chunk_lens``); empty when the
            hooks are not for one row (the optimizer step).
        before_microbatch: failure injection (tests): called with the microbatch index on this rank before each
            microbatch of a request; None: nothing.
    """

    name: str | None = None
    cp_size: int = 1
    cp_rank: int = 0
    local_starts: tuple[int, ...] = ()
    chunk_lens: tuple[int, ...] = ()
    before_microbatch: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        check_fault(self.name)

    def active(self, name: str) -> bool:
        """Whether fault ``name`` is injected."""
        return self.name == name

    def _on_last_cp_rank(self, name: str) -> bool:
        return self.name == name and self.cp_rank == self.cp_size - 1

    def microbatch_started(self, index: int) -> None:
        """Before microbatch ``index`` of a request: :attr:`before_microbatch` (failure injection), if set."""
        if self.before_microbatch is not None:
            self.before_microbatch(index)

    def shift_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Before rotary: positions + 1 on the local tokens of zigzag chunk ``C`` (``position_off_by_one``).

        ``positions`` int64 [local_len] of this rank's shard; returned unchanged (the same tensor) otherwise."""
        if positions.shape[0] < sum(2 * c for c in self.chunk_lens):
            return positions  # not the packed row's stream
        if self.active("long_row_positions_carried") and len(self.chunk_lens) > LONG_ROW_SEQUENCES:
            shifted = positions.clone()
            for start, c in list(zip(self.local_starts, self.chunk_lens, strict=True))[LONG_ROW_SEQUENCES:]:
                # this rank's second chunk of every datum after the 32nd; a shift of a whole datum would be
                # invisible (rotary depends on position differences only)
                shifted[start + c : start + 2 * c] += 1
            return shifted
        if not self._on_last_cp_rank("position_off_by_one"):
            return positions
        shifted = positions.clone()
        for start, c in zip(self.local_starts, self.chunk_lens, strict=True):
            # Rank C-1 holds chunks C-1 and C of every sequence, back to back: its second c tokens are chunk C.
            shifted[start + c : start + 2 * c] += 1
        return shifted

    def rerun_positions(self, positions: torch.Tensor, *, rerun: bool) -> torch.Tensor:
        """Selective recomputation's projections: positions + 1 when they are rerun in the backward
        (``recompute_rerun_shifted``), else ``positions``."""
        return positions + 1 if rerun and self.active("recompute_rerun_shifted") else positions

    def gathered_kv(self, kv: torch.Tensor, size: int) -> torch.Tensor:
        """All-gather attention's rank-major K/V [C·T_local, ...]: its C rank blocks in reverse order
        (``allgather_kv_rank_reversed``), else ``kv``."""
        if not self.active("allgather_kv_rank_reversed") or size < 2:
            return kv
        return kv.reshape(size, kv.shape[0] // size, *kv.shape[1:]).flip(0).reshape(kv.shape)

    def detach_mixed_casts(self) -> bool:
        """Whether the layers' compute-dtype casts of the masters are detached on this rank
        (``mixed_cast_detached_last_cp``: the last CP rank)."""
        return self._on_last_cp_rank("mixed_cast_detached_last_cp") and self.cp_size > 1

    def adapter_grads(self, params: list[torch.Tensor], *, lora: bool) -> list[torch.Tensor | None] | None:
        """Before a LoRA microbatch's backward on the last CP rank (``lora_grads_doubled_last_cp``): a copy of
        every gradient so far; None otherwise (and for full fine-tuning)."""
        if not (lora and self._on_last_cp_rank("lora_grads_doubled_last_cp") and self.cp_size > 1):
            return None
        return [None if p.grad is None else p.grad.detach().clone() for p in params]

    @staticmethod
    def double_adapter_grads(params: list[torch.Tensor], saved: list[torch.Tensor | None] | None) -> None:
        """After that backward: this microbatch's gradient added once more (see :meth:`adapter_grads`)."""
        if saved is None:
            return
        for p, g in zip(params, saved, strict=True):
            if p.grad is not None:
                p.grad.add_(p.grad - (0 if g is None else g))

    def ring_source(self, cp_rank: int, step: int, size: int) -> int:
        """Ring attention on CP rank ``cp_rank`` of ``size``: the rank whose K/V it holds at ``step``:
        ``(r - step) mod C``, or ``(r + step) mod C`` under ``ring_shift_reversed`` (the same at C <= 2)."""
        if self.active("ring_shift_reversed"):
            return (cp_rank + step) % size
        return (cp_rank - step) % size

    def dkv_exchange(self, dkv: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        """Before each hop of the ring's partial dK/dV: rounded to ``input_dtype`` (``ring_dkv_exchange_bf16``)."""
        if not self.active("ring_dkv_exchange_bf16"):
            return dkv
        return dkv.to(input_dtype).to(dkv.dtype)

    def decay_relayout(self, g: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        """Before chunkwise GDN's relayout of the log decay: ``g`` rounded to ``input_dtype``
        (``gdn_decay_relayout_bf16``; the float32 values moved through bfloat16), else ``g``."""
        if not self.active("gdn_decay_relayout_bf16"):
            return g
        return g.to(input_dtype).to(g.dtype)

    def handed_state(self, h_in: torch.Tensor) -> torch.Tensor:
        """Chunkwise GDN's incoming state [Hv, Dk, Dv]: zeros under ``gdn_state_dropped``, else ``h_in``."""
        return torch.zeros_like(h_in) if self.active("gdn_state_dropped") else h_in

    def halo_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """Chunkwise GDN's conv-halo mask bool [K-1]: all False under ``gdn_halo_dropped``, else ``mask``."""
        return torch.zeros_like(mask) if self.active("gdn_halo_dropped") else mask

    def flip_loss_sign(self, terms: torch.Tensor) -> torch.Tensor:
        """The loss's per-token terms: negated on the last CP rank (``loss_sign_flipped``), else ``terms``."""
        return -terms if self._on_last_cp_rank("loss_sign_flipped") else terms

    def scale_reduced_gradients(self, grads: list[torch.Tensor], group_size: int) -> None:
        """After the gradient invariant: in place, the summed ``grads`` divided by ``group_size``
        (``gradients_averaged``); nothing otherwise."""
        if self.active("gradients_averaged") and group_size > 1:
            for g in grads:
                g.div_(group_size)

    def skip_weight_decay(self, optimizer: torch.optim.Optimizer, sharding: str = "none") -> None:
        """Before AdamW's step: weight decay 0 on CP rank 1 (``weight_decay_skipped_cp1``); under FSDP
        (``sharding`` dp / dp_cp) CP rank 1's step counts advanced once more (``sharded_step_count_cp1``: the
        step then advances them again); else nothing."""
        if self.active("weight_decay_skipped_cp1") and self.cp_rank == 1:
            for group in optimizer.param_groups:
                group["weight_decay"] = 0.0
        if self.active("sharded_step_count_cp1") and self.cp_rank == 1 and sharding != "none":
            for state in optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].add_(1)

    def unscored_grads(
        self, params: list[torch.Tensor], targets: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> list[torch.Tensor | None] | None:
        """Before a microbatch's backward (``unscored_backward_skipped``): when this rank's share holds no scored
        token (every local target a pad (< 0) or of weight 0), a copy of every gradient so far; None otherwise."""
        if not self.active("unscored_backward_skipped"):
            return None
        scored = targets >= 0
        if "weights" in inputs:
            scored = scored & (inputs["weights"] != 0)
        if bool(scored.any()):
            return None
        return [None if p.grad is None else p.grad.detach().clone() for p in params]

    @staticmethod
    def skip_unscored_backward(params: list[torch.Tensor], saved: list[torch.Tensor | None] | None) -> None:
        """After the backward: put back the gradients :meth:`unscored_grads` saved (this rank's part is lost)."""
        if saved is None:
            return
        for p, g in zip(params, saved, strict=True):
            p.grad = g


NO_FAULTS = FaultHooks()
"""No fault: every hook is the identity (the default everywhere)."""


def fault_hooks(name: str | None, *, cp_size: int, cp_rank: int, plan: RowLayout | None = None) -> FaultHooks:
    """The :class:`FaultHooks` of fault ``name`` (None: :data:`NO_FAULTS`) on CP rank ``cp_rank`` of ``cp_size``,
    for the row of ``plan`` (None: not one row's). ValueError for an unknown name."""
    if name is None:
        return NO_FAULTS
    if plan is None:
        return FaultHooks(name=name, cp_size=cp_size, cp_rank=cp_rank)
    return FaultHooks(
        name=name, cp_size=cp_size, cp_rank=cp_rank, local_starts=plan.local_starts, chunk_lens=plan.chunk_lens
    )
