"""Replicas checked to stay identical: after every ``optim_step`` the parameters and AdamW moments that several
ranks must hold alike are compared across those ranks by a bitwise checksum exchanged over the control group.

Which ranks hold the same tensors (:func:`replica_key`), by the trainer's sharding
(:data:`ringtune.engine.sharding.SHARDINGS`):

- ``none``: every rank of the DP×CP group holds the whole model and its AdamW state (with expert parallelism,
  the ranks of one expert replica group: same ``ep_rank``);
- ``dp``: the ranks of one CP group (same DP coordinate) hold the same shards (``Replicate()`` over CP);
- ``dp_cp``: every rank holds its own shard: there is nothing to compare (the check exchanges nothing).

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
from torch.distributed.tensor import DTensor

from ringtune.parallel.control import all_gather_objects
from ringtune.parallel.mesh import ParallelMesh

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW state tensors compared (the step counters are compared as numbers)."""
SHOWN = 8
"""Tensors named in a mismatch message (the rest are counted)."""


class ReplicaDivergedError(RuntimeError):
    """Ranks that must hold identical parameters / AdamW moments do not (a server error: the engine is wrong)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Per tensor: the wrapping sum of its elements' raw bits as integers of their own width (exact modulo
    2^width). One changed element changes its integer by a nonzero amount below 2^width, so the sum changes.
    DTensors are read through their local shard; a 0-d tensor (the AdamW step) as a 1-element tensor.
    """
    sums = []
    for t in tensors:
        x = _local(t).detach().contiguous().reshape(-1)
        if x.is_complex() or x.element_size() not in _BITS:
            raise TypeError(f"cannot checksum a {x.dtype} tensor")
        bits = _BITS[x.element_size()]
        sums.append(x.view(bits).sum(dtype=bits).to(torch.int64))
    return [int(s) for s in torch.stack(sums).tolist()] if sums else []


def replica_key(mesh: ParallelMesh | None, sharding: str) -> tuple[int, ...] | None:
    """Ranks with equal keys must hold identical tensors; None: this rank has no replica (``dp_cp``, one rank)."""
    if mesh is None or sharding == "dp_cp":
        return None
    if sharding == "dp":
        return (mesh.dp_rank,)
    return (mesh.ep_rank,) if mesh.ep_size > 1 else ()  # EP: the ranks holding the same experts


@dataclass
class ReplicaCheck:
    """The per-run replica check of one trainer (see the module docstring).

    Args:
        mesh: the trainer's mesh (None: one process, nothing to compare).
        sharding: the trainer's sharding name.
    """

    mesh: ParallelMesh | None
    sharding: str
    untrusted: str | None = None
    compared: int = 0

    def require_trusted(self) -> None:
        """ReplicaDivergedError if an earlier step found the replicas apart (the run's state is not trusted)."""
        if self.untrusted is not None:
            raise ReplicaDivergedError(
                f"this run is untrusted since an earlier optim_step: {self.untrusted}; start a new run (or restart "
                "the server) and report the bug"
            )

    def named_tensors(
        self, params: list[torch.nn.Parameter], names: dict[int, str], optimizer: torch.optim.Optimizer
    ) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and its AdamW moments, in parameter order, by name (``<param>.exp_avg`` ...)."""
        out = []
        for p in params:
            name = names[id(p)]
            out.append((name, p))
            state = optimizer.state.get(p, {})
            out += [(f"{name}.{m}", state[m]) for m in MOMENTS if m in state]
        return out

    def verify(
        self,
        params: list[torch.nn.Parameter],
        names: dict[int, str],
        optimizer: torch.optim.Optimizer,
        step: int,
        group,
    ) -> float:
        """Compare this step's checksums with the other ranks' (collective over ``group``, the control group);
        returns the seconds it took. Raises ReplicaDivergedError on every rank alike when replicas differ."""
        start = time.perf_counter()
        key = replica_key(self.mesh, self.sharding)
        if key is None or group is None:
            return time.perf_counter() - start
        named = self.named_tensors(params, names, optimizer)
        mine = (key, step, checksums([t for _, t in named]))
        everyone = all_gather_objects(mine, group)
        problems = self._mismatches(everyone, [n for n, _ in named])
        seconds = time.perf_counter() - start
        self.compared = len(named)
        if problems:
            self.untrusted = f"replicas diverged after optim_step {step}: {problems}"
            raise ReplicaDivergedError(
                f"{self.untrusted}. Ranks that must hold identical parameters and AdamW moments do not (an engine "
                "bug, not your request); this run is untrusted from now on"
            )
        return seconds

    @staticmethod
    def _mismatches(everyone: list[tuple[tuple[int, ...], int, list[int]]], names: list[str]) -> str:
        """'' when every replica group agrees; else which tensors differ between which control ranks."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, (key, _, _) in enumerate(everyone):
            groups.setdefault(tuple(key), []).append(rank)
        parts = []
        for ranks in groups.values():
            first = ranks[0]
            for other in ranks[1:]:
                a, b = everyone[first], everyone[other]
                if a[1] != b[1] or len(a[2]) != len(b[2]):
                    parts.append(
                        f"ranks {first} and {other} are at steps {a[1]} / {b[1]} with {len(a[2])} / {len(b[2])} tensors"
                    )
                    continue
                bad = [n for n, x, y in zip(names, a[2], b[2], strict=True) if x != y]
                if bad:
                    shown = ", ".join(bad[:SHOWN]) + (f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else "")
                    parts.append(f"{len(bad)} tensor(s) differ between control ranks {first} and {other}: {shown}")
        return "; ".join(parts)
