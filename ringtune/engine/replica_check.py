"""Replicas checked to stay identical: after every ``optim_step`` every tensor that several ranks must hold alike
(parameters, AdamW moments and step counts, buffers and fixed tables) is compared across those ranks by a
bitwise checksum exchanged over the control group.

Which ranks hold the same copy is decided **per tensor** (:func:`tensor_key`): ranks whose keys for a tensor are
equal must hold it bit-identically.

- a plain (unsharded) tensor: every rank of the DP×CP group (key ``()``), except a routed expert's tensor under
  expert parallelism: the ranks with the same ``ep_rank`` (its expert replica group);
- a DTensor (FSDP2, :mod:`ringtune.engine.sharding`): the ranks with the same coordinates on the mesh dims it is
  ``Shard``-ed over; ``Replicate`` dims do not split it. So under ``--shard-params dp`` (placements
  ``(Replicate(), Shard(0))`` on ``("cp", "dp")``) the ranks of one CP group compare their DP shard, and under
  ``dp_cp`` (``(Shard(0),)`` on ``("dp_cp",)``) no two ranks share a shard of a parameter or moment, but every
  rank still holds the AdamW step counts and the unsharded state whole, and those are compared across all ranks;
- AdamW's per-parameter ``step`` counts: every rank (a rank that counted one step more or less would use another
  bias correction on its shard);
- registered buffers and the rotary ``inv_freq`` tables (plain attributes, never cast): every rank.

(The MoE router's *weights* are parameters, compared above; its recorded load statistics count each rank's own
tokens, so they differ between ranks by design and are not compared.)

Replicas run identical math on identical reduced gradients (the SUM over DP×CP is one all-reduce whose result
every rank receives), so they are expected to be *bit-identical*, in float32, float64, bfloat16 and bf16-mixed
alike. The checksum of a tensor (:func:`checksums`) is the sum of its raw bits read as integers of the element's
own width (int16 / int32 / int64), wrapping, so exact modulo 2^width: a change of one element's bits changes its
integer by a nonzero amount below 2^width, so it changes the sum (+0/-0 and NaN payloads included). Summing in
the element's own width keeps it one vectorised read of every parameter and moment per step (widening each
element to int64 first cost ~65x more); benchmarks/replica_check.py measures it.

A mismatch raises :class:`ReplicaDivergedError` (a server error, not a user error: the engine is wrong), naming
the tensors and the ranks that disagree, on every rank alike; the run is *untrusted* from then on and every later
request of it fails with that message (:meth:`ReplicaCheck.require_trusted`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ringtune.models.layers.moe import is_expert_parameter
from ringtune.parallel.control import all_gather_objects
from ringtune.parallel.mesh import ParallelMesh

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW state tensors compared beside each parameter (plus its ``step`` count, on every rank)."""
SHOWN = 8
"""Tensors named in a mismatch message (the rest are counted)."""
Key = tuple[tuple[str, int], ...]
"""Who must agree on one tensor: (mesh dim, coordinate) pairs; ranks with equal keys hold equal copies."""


class ReplicaDivergedError(RuntimeError):
    """Ranks that must hold identical parameters / AdamW moments do not (a server error: the engine is wrong)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of ``t``'s raw bits read as integers of its element's own width (a 0-d int8 / int16 / int32
    / int64 tensor on ``t``'s device; 0 for an empty tensor). Sums of parts combine into the sum of the whole by
    :func:`combined_bit_sums` (addition modulo 2^width is order-free). TypeError for a complex tensor."""
    x = t.detach().contiguous().reshape(-1)
    if x.is_complex() or x.element_size() not in _BITS:
        raise TypeError(f"cannot checksum a {x.dtype} tensor")
    bits = _BITS[x.element_size()]
    return x.view(bits).sum(dtype=bits)


def combined_bit_sums(parts: list[list[torch.Tensor]]) -> list[int]:
    """Per list of :func:`bit_sum` results of one tensor's blocks, the checksum of the whole tensor (what
    :func:`checksums` gives for it), read back together."""
    whole = [torch.stack(p).sum(dtype=p[0].dtype).to(torch.int64) for p in parts if p]
    values = iter(torch.stack(whole).tolist() if whole else [])
    return [int(next(values)) if p else 0 for p in parts]  # an empty tensor's sum is 0


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Per tensor: the wrapping sum of its elements' raw bits as integers of their own width (exact modulo
    2^width). One changed element changes its integer by a nonzero amount below 2^width, so the sum changes.
    DTensors are read through their local shard; a 0-d tensor (the AdamW step) as a 1-element tensor.
    """
    sums = [bit_sum(_local(t)).to(torch.int64) for t in tensors]
    return [int(s) for s in torch.stack(sums).tolist()] if sums else []


def tensor_key(t: torch.Tensor, name: str, mesh: ParallelMesh | None) -> Key:
    """The ranks that must hold ``t`` (called ``name``; a moment is named after its parameter) identically: those
    whose key is equal (module docstring). A DTensor: its coordinates on the mesh dims it is sharded over; a
    routed expert's tensor under EP adds ``("ep", ep_rank)``; anything else ``()`` (every rank)."""
    key: list[tuple[str, int]] = []
    if isinstance(t, DTensor):
        mesh_d = t.device_mesh
        coords = mesh_d.get_coordinate() or []
        dims = mesh_d.mesh_dim_names or tuple(str(i) for i in range(mesh_d.ndim))
        key += [(str(dims[i]), int(coords[i])) for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if mesh is not None and mesh.ep_size > 1 and is_expert_parameter(name):
        key.append(("ep", mesh.ep_rank))
    return tuple(key)


def replicated_state(model: nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    """The model's unsharded non-parameter state every rank holds whole: registered buffers and the rotary
    ``inv_freq`` tables (plain tensor attributes), by name."""
    if model is None:
        return []
    out = [(f"buffer:{n}", b) for n, b in model.named_buffers() if b.is_floating_point() or b.dtype == torch.int64]
    for n, m in model.named_modules():
        freq = getattr(m, "inv_freq", None)
        if isinstance(freq, torch.Tensor) and not isinstance(freq, nn.Parameter):
            out.append((f"table:{n}.inv_freq", freq))
    return out


@dataclass
class ReplicaCheck:
    """The per-run replica check of one trainer (see the module docstring).

    Args:
        mesh: the trainer's mesh (None: one process, nothing to compare).
        sharding: the trainer's sharding name (recorded; the keys come from each tensor's placements).
        model: the trainer's model, whose buffers and rotary tables are compared too (None: parameters and
            AdamW state only).
    """

    mesh: ParallelMesh | None
    sharding: str
    model: nn.Module | None = None
    untrusted: str | None = None
    compared: int = 0

    def require_trusted(self) -> None:
        """ReplicaDivergedError if an earlier step found the replicas apart (the run's state is not trusted)."""
        if self.untrusted is not None:
            raise ReplicaDivergedError(
                f"this run is untrusted since an earlier optim_step: {self.untrusted}; start a new run (or restart "
                "the server) and report the bug"
            )

    @property
    def compares(self) -> bool:
        """Whether :meth:`verify` compares anything: not in one process (no mesh), where the optimizer step need
        not take checksums either."""
        return self.mesh is not None

    def named_tensors(
        self, params: list[torch.nn.Parameter], names: dict[int, str], optimizer: torch.optim.Optimizer
    ) -> list[tuple[str, torch.Tensor, Key]]:
        """Every parameter with its AdamW moments and step count (``<param>.exp_avg``, ``<param>.step``), then the
        model's :func:`replicated_state`, each with its :func:`tensor_key`."""
        out = []
        for p in params:
            name = names[id(p)]
            key = tensor_key(p, name, self.mesh)
            out.append((name, p, key))
            state = optimizer.state.get(p, {})
            out += [(f"{name}.{m}", state[m], key) for m in MOMENTS if m in state]
            if isinstance(state.get("step"), torch.Tensor):
                out.append((f"{name}.step", state["step"], tensor_key(state["step"], "", self.mesh)))
        out += [(n, t, tensor_key(t, n, self.mesh)) for n, t in replicated_state(self.model)]
        return out

    def verify(
        self,
        params: list[torch.nn.Parameter],
        names: dict[int, str],
        optimizer: torch.optim.Optimizer,
        step: int,
        group,
        known: dict[int, int] | None = None,
    ) -> float:
        """Compare this step's checksums with the other ranks' (collective over ``group``, the control group);
        returns the seconds it took. ``known``: checksums already taken of tensors unchanged since, by ``id``
        (e.g. the optimizer step's, :func:`~ringtune.engine.blocked_adamw.blocked_step`); the others are taken
        here. Raises ReplicaDivergedError on every rank alike when replicas differ."""
        start = time.perf_counter()
        if not self.compares or group is None:
            return time.perf_counter() - start
        named = self.named_tensors(params, names, optimizer)
        known = known or {}
        missing = [t for _, t, _ in named if id(t) not in known]
        fresh = iter(checksums(missing))
        sums = [known[id(t)] if id(t) in known else next(fresh) for _, t, _ in named]
        mine = (step, [k for _, _, k in named], sums)
        everyone = all_gather_objects(mine, group)
        problems, self.compared = self._mismatches(everyone, [n for n, _, _ in named])
        seconds = time.perf_counter() - start
        if problems:
            self.untrusted = f"replicas diverged after optim_step {step}: {problems}"
            raise ReplicaDivergedError(
                f"{self.untrusted}. Ranks that must hold identical parameters and AdamW moments do not (an engine "
                "bug, not your request); this run is untrusted from now on"
            )
        return seconds

    @staticmethod
    def _mismatches(everyone: list[tuple[int, list[Key], list[int]]], names: list[str]) -> tuple[str, int]:
        """('' when every replica group agrees, else which tensors differ between which control ranks; the
        number of tensors this rank shares with at least one other rank, i.e. compared)."""
        first_step, first_keys = everyone[0][0], everyone[0][1]
        for rank, (step, _, sums) in enumerate(everyone):
            if step != first_step or len(sums) != len(first_keys):
                return (
                    f"ranks 0 and {rank} are at steps {first_step} / {step} with {len(first_keys)} / {len(sums)} "
                    "tensors",
                    0,
                )
        bad: dict[tuple[int, int], list[str]] = {}
        compared = 0
        for i, name in enumerate(names):
            holders: dict[tuple, list[int]] = {}
            for rank, (_, keys, _) in enumerate(everyone):
                holders.setdefault(tuple(keys[i]), []).append(rank)
            compared += any(len(r) > 1 for r in holders.values())
            for ranks in holders.values():
                first = ranks[0]
                for other in ranks[1:]:
                    if everyone[first][2][i] != everyone[other][2][i]:
                        bad.setdefault((first, other), []).append(name)
        parts = []
        for (first, other), tensors in bad.items():
            shown = ", ".join(tensors[:SHOWN]) + (f" and {len(tensors) - SHOWN} more" if len(tensors) > SHOWN else "")
            parts.append(f"{len(tensors)} tensor(s) differ between control ranks {first} and {other}: {shown}")
        return "; ".join(parts), compared
