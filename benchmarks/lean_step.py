"""Host syncs, collectives and optimizer time of one training step of SmolLM2-135M on CPU (issue 31, lean steps).

Run ``python benchmarks/lean_step.py [--steps 3] [--tokens 256]``. Two gloo ranks, one thread each, load the
embedded SmolLM2-135M (float32) into a :class:`~ringtune.engine.trainer.Trainer` at CP=1 (DP=2, replicated) and CP=2
(DP=1); each step is one ``forward_backward`` of two microbatches per rank (cross_entropy) and one ``optim_step``.
Counted on every rank, per step (median over the steps after the first, which creates the AdamW moments):

- host syncs: calls that read a tensor's value back to Python (``Tensor.item`` / ``tolist`` / ``cpu`` / ``numpy`` /
  ``__bool__`` / ``__float__`` / ``__int__``; on CUDA each is a device sync; on CPU ``cpu()`` of a CPU tensor is
  counted too, as it would sync on GPU), per optim_step (those inside the update shown apart: on CPU torch's
  single-tensor AdamW reads the step count back once per call, and the blocked step calls it once per block;
  fused on CUDA reads none) and per microbatch (between two calls of the trainer's ``faults.before_microbatch``;
  the last microbatch also carries the request's tail);
- gradient overlap: the replicated gradients' buckets all-reduced from backward hooks during the request's last
  microbatch (:mod:`ringtune.engine.grad_overlap`), how many were launched before backward ended, and the wait
  for them at the request's end (communication not hidden behind backward); optim_step then copies them in;
- collectives: calls of ``torch.distributed`` collectives (outermost only: an ``all_gather_object`` counts once) and
  of the control plane's store exchanges (:data:`STORE_EXCHANGES`), per optim_step and per microbatch, with the
  seconds spent in them;
- optimizer time: ``optim_step``'s wall time less the gradient reduction (``GradientInvariant.reduce_and_check``:
  the SUM over the gloo ranks, its bucket packing, the canary check) and the other collectives (communication, not
  optimizer work), over one plain ``torch.optim.AdamW.step`` on the same parameters and moments after it (the
  trainer's own AdamW; gradients of zeros, equal on every rank so the replicas stay identical: AdamW's work does not
  depend on the values; that step moves the weights and moments, so their maxima are then recorded, untimed, as
  the bounds the trainer's own step would have carried, :mod:`ringtune.engine.state_bounds`); with, inside it,
  the update's time (:func:`~ringtune.engine.optimizer.apply_step`: clipping, AdamW and, on the CPU, the replica
  checksums taken block by block, :mod:`ringtune.engine.blocked_adamw`) and the replica check's
  (:mod:`ringtune.engine.replica_check`, which has its own benchmark).

Prints one line per configuration (rank 0's figures; rank 1's are alike) and the parameter tensor count, so an
O(parameters) count shows as such.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ringtune.engine import optimizer as optimizer_module
from ringtune.engine import update_guard
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.replica_check import MOMENTS
from ringtune.engine.state_bounds import StateBounds
from ringtune.engine.tensor_norms import max_abs
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT, load_model
from ringtune.parallel import control

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.harness import RankPool

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
"""Tensor methods that read a value back to the host (a device sync on CUDA)."""

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "gather",
    "scatter",
    "reduce",
)
"""``torch.distributed`` functions counted as one collective call each."""

STORE_EXCHANGES = ("broadcast_from", "exchange_objects", "gather_objects_to")
"""The control plane's exchanges through the TCP store (:mod:`ringtune.parallel.store_exchange`, called from
:mod:`ringtune.parallel.control`): counted as collectives too (every rank of the group takes part)."""

ADAM = AdamParams(learning_rate=1e-5, weight_decay=0.01, grad_clip_norm=1.0)


def _call_site() -> str:
    """``file.py:function`` of the nearest caller outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith("lean_step.py"):
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class Counts:
    """Host syncs and collectives counted while :meth:`counting` is active (the outermost call of each)."""

    def __init__(self) -> None:
        self.syncs: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self.collective_s = 0.0
        self._depth = 0

    def total(self) -> tuple[int, int, float]:
        return sum(self.syncs.values()), sum(self.collectives.values()), self.collective_s

    def _wrap_sync(self, name: str, original: Callable) -> Callable:
        def wrapper(t, *args, **kwargs):
            if self._depth == 0:
                self.syncs[f"{name} in {_call_site()}"] += 1
            return original(t, *args, **kwargs)

        return wrapper

    def _wrap_collective(self, name: str, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if self._depth > 0:
                return original(*args, **kwargs)
            self.collectives[name] += 1
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.collective_s += time.perf_counter() - start
                self._depth -= 1

        return wrapper

    @contextmanager
    def counting(self) -> Iterator[Counts]:
        """Patch the tensor methods and the collectives (module attributes of torch.distributed and c10d)."""
        saved: list[tuple[object, str, object]] = []
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            saved.append((torch.Tensor, name, torch.Tensor.__dict__.get(name)))
            setattr(torch.Tensor, name, self._wrap_sync(name, original))
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap_collective(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapped)
        for name in STORE_EXCHANGES:
            original = getattr(control, name)
            saved.append((control, name, original))
            setattr(control, name, self._wrap_collective(f"store.{name}", original))
        try:
            yield self
        finally:
            for owner, name, original in reversed(saved):
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


def _data(vocab: int, lens: tuple[int, ...], seed: int) -> list[TrainDatum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen), "weights": torch.ones(n)}
        out.append(TrainDatum(tokens=tokens, inputs=inputs))
    return out


def measure(ctx, *, cp: int, tokens: int, steps: int) -> dict[str, float]:
    """On every rank: per-step medians of syncs, collectives and times (see the module docstring)."""
    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=2 // cp, cp=cp)
    model = load_model(EMBEDDED_DEFAULT, dtype=torch.float32)
    trainer = Trainer(model, mesh, max_tokens_per_rank=tokens)
    dp = 2 // cp
    # two microbatches per rank: each row fills one rank's budget at this CP (minus padding slack)
    lens = tuple([tokens * cp - 16] * (2 * dp))
    counts = Counts()
    inside: dict[str, float] = {}  # seconds and host syncs inside torch's AdamW step and the replica check
    plain_step = trainer.optimizer.step
    # torch's AdamW as a user constructs it (torch.optim.AdamW(params): on the CPU its per-tensor loop), with its own
    # moments, when the trainer's kernel is another one (the CPU default is fused since 2026-12-07: both are shown)
    user_adamw = None if not trainer.optimizer.param_groups[0]["fused"] else torch.optim.AdamW(trainer.params, lr=1e-9)
    # the update: clipping, AdamW and (CPU, blocked) the replica checksums taken on the way
    update_guard.apply_step = _timed(optimizer_module.apply_step, "update", inside, counts)
    trainer.replicas.verify = _timed(trainer.replicas.verify, "replica", inside, counts)
    # the gradient SUM with its invariant check (collectives, bucket packing, canary): communication, not optimizer
    trainer.invariant.reduce_and_check = _timed(trainer.invariant.reduce_and_check, "reduce", inside, counts)
    marks: list[tuple[int, int, float]] = []
    trainer.faults = replace(trainer.faults, before_microbatch=lambda m: marks.append(counts.total()))
    rows: list[dict[str, float]] = []
    for step in range(steps):
        data = _data(model.config.vocab_size, lens, seed=step)
        marks.clear()
        with counts.counting():
            start = time.perf_counter()
            trainer.forward_backward(data, "cross_entropy")
            fb_s = time.perf_counter() - start
            end_fb = counts.total()
            pending = getattr(trainer.grad_sync, "overlapped", None)  # the reduction made during backward, if any
            before = counts.total()
            sites = Counter(counts.syncs)
            inside.clear()
            start = time.perf_counter()
            trainer.optim_step(ADAM)
            step_s = time.perf_counter() - start
            after = counts.total()
            sites = Counter({k: v for k, v in (counts.syncs - sites).items() if v})
        per_mb = [b[0] - a[0] for a, b in zip(marks, [*marks[1:], end_fb], strict=True)]
        coll_mb = [b[1] - a[1] for a, b in zip(marks, [*marks[1:], end_fb], strict=True)]
        for p in trainer.params:  # the same on every rank, so the replicas stay identical (the check runs)
            p.grad = torch.zeros_like(p)
        start = time.perf_counter()
        plain_step()  # the plain AdamW step on the same parameters and moments
        plain_s = time.perf_counter() - start
        user_s = math.nan
        if user_adamw is not None:
            start = time.perf_counter()
            user_adamw.step()  # the same zero gradients
            user_s = time.perf_counter() - start
        trainer.optimizer.zero_grad(set_to_none=True)
        # that step moved the weights and moments the trainer's step had carried bounds of: record their maxima as
        # that step's own bounds would have been (untimed), so the next optim_step reads what the service's would
        record_exact_bounds(trainer.state_bounds, trainer.optimizer, trainer.params)
        # less the gradient reduction (its collectives included) and the other collectives (verdicts, peaks)
        optimizer_s = step_s - inside["reduce_s"] - (after[2] - before[2] - inside["reduce_collective_s"])
        rows.append(
            {
                "step_syncs": after[0] - before[0],
                "step_syncs_outside_update": after[0] - before[0] - inside["update_syncs"],
                "update_syncs": inside["update_syncs"],
                "update_in_step_s": inside["update_s"],
                "replica_check_s": inside["replica_s"],
                "step_collectives": after[1] - before[1],
                "mb_syncs_first": per_mb[0],
                "mb_syncs_last": per_mb[-1],
                "mb_collectives_first": coll_mb[0],
                "mb_collectives_last": coll_mb[-1],
                "forward_backward_s": fb_s,
                "buckets": float(len(pending.buckets)) if pending is not None else 0.0,
                "buckets_in_backward": float(pending.launched_in_backward) if pending is not None else 0.0,
                "overlap_wait_s": pending.wait_s if pending is not None else 0.0,
                "microbatches": len(per_mb),
                "optim_step_s": step_s,
                "collective_s": after[2] - before[2],
                "reduce_s": inside["reduce_s"],
                "optimizer_s": optimizer_s,
                "plain_adamw_s": plain_s,
                "optimizer_over_plain": optimizer_s / plain_s,
                "user_adamw_s": user_s,
                "optimizer_over_user": optimizer_s / user_s,
            }
        )
    later = rows[1:] or rows
    out = {k: statistics.median(r[k] for r in later) for k in rows[0]}
    out["parameter_tensors"] = float(len(trainer.params))
    out["sites"] = dict(sites.most_common(6))  # the last step's host syncs by call site (outside AdamW's own too)
    return out


def record_exact_bounds(known: StateBounds, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Record in ``known`` each weight's and AdamW moment's exact max |x| as its carried bound: what the trainer's
    own step leaves, after a step outside it (the plain AdamW step timed beside it) moved them."""
    state = [t for p in params for t in (p, *(optimizer.state[p][k] for k in MOMENTS))]
    known.record(state, max_abs([t.detach() for t in state]).tolist())


def _timed(fn: Callable, name: str, into: dict[str, float], counts: Counts) -> Callable:
    """``fn`` that adds its seconds, host syncs and seconds in collectives to ``into[name + "_s"]``,
    ``into[name + "_syncs"]`` and ``into[name + "_collective_s"]``."""

    def wrapper(*args, **kwargs):
        syncs, _, collective_s = counts.total()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            now = counts.total()
            into[f"{name}_s"] = into.get(f"{name}_s", 0.0) + time.perf_counter() - start
            into[f"{name}_syncs"] = into.get(f"{name}_syncs", 0.0) + now[0] - syncs
            into[f"{name}_collective_s"] = into.get(f"{name}_collective_s", 0.0) + now[2] - collective_s

    return wrapper


def interleaved(rounds: int) -> None:
    """The optimizer step's own work beside one AdamW step, in one process (1 thread), interleaved over ``rounds``:
    plain AdamW (the trainer's kernel, ``optimizer.step()``), then per variant the step's reads of the model and
    AdamW. ``main`` (as on main before the lean guard): one sweep of the gradients for the norm and their maxima
    (:func:`~ringtune.engine.tensor_norms.squares_and_max_abs`), the maxima of every weight and moment, clipping,
    AdamW, the replica checksums: 8 reads of a parameter-sized tensor per parameter besides AdamW's (clipping's
    read and write counted once). ``lean``: the gradients' sweep for the norm and their own L2 norms (no maxima,
    :func:`~ringtune.engine.tensor_norms.squares_and_norms`), the weights' and moments' bounds carried from the
    previous step (:mod:`ringtune.engine.state_bounds`: nothing read; recorded untimed before each round, as the
    other variants moved the weights in between), then clipping, AdamW and the checksums each over the whole model
    in turn: 5. ``blocked`` (the trainer's step now): the same sweep and bounds, then clipping, AdamW and the
    checksums block by block while each block is in cache (:mod:`ringtune.engine.blocked_adamw`): 1 besides one
    AdamW that itself reads the model once per block rather than once per pass. These four run torch's per-tensor
    AdamW (``torch_default``, as ``torch.optim.AdamW(params)`` does on the CPU). ``fused kernel``: torch's fused
    AdamW alone (its own moments), and ``fused``: the trainer's step on it, the CPU default since 2026-12-07 (the
    sweep, the carried bounds, clipping inside the kernel, then the replica checksums' three reads). Prints each
    variant's (reads + AdamW) / AdamW for the fastest rounds, for the medians, and per round (each over the AdamW
    step of the same round, which shares its load): the least and the median."""
    from ringtune.engine.optimizer import apply_step, new_adamw, prepare_step
    from ringtune.engine.replica_check import checksums
    from ringtune.engine.tensor_norms import squares_and_max_abs, squares_and_norms
    from ringtune.engine.update_guard import (
        StepFigures,
        carry_bounds,
        planned_bounds,
        read_step_figures,
        unsafe_updates,
    )

    torch.set_num_threads(1)
    model = load_model(EMBEDDED_DEFAULT, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = new_adamw(params, "torch_default")  # the variants below: torch's per-tensor loop on the CPU
    fused = new_adamw(params, "fused")  # the trainer's CPU default since 2026-12-07, with its own moments
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]
    known, known_fused = StateBounds(), StateBounds()

    def fresh_grads() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()

    def moments(opt: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        return [[opt.state[p][k] for p in params] for k in MOMENTS]

    def step(variant: str) -> None:
        opt, bounds = (fused, known_fused) if variant == "fused" else (optimizer, known)
        local = [p.grad for p in params]
        if variant == "main":
            squares, grad_max = squares_and_max_abs(local)
            m, v = moments(opt)
            values = torch.cat([squares.sqrt().reshape(1), max_abs(params), grad_max, max_abs(m), max_abs(v)]).tolist()
            n = len(params)
            figures = StepFigures(values[0], values[1 : 1 + n], values[1 + n : 1 + 2 * n],
                                  values[1 + 2 * n : 1 + 3 * n], values[1 + 3 * n :], [False] * n)  # fmt: skip
        else:
            squares, grad_norms = squares_and_norms(local)
            figures = read_step_figures(params, opt, squares.sqrt(), grad_norms, bounds)
        scale = prepare_step(opt, ADAM, norm=figures.norm)  # the clip factor (the norm is above 1)
        assert scale < 1.0 and unsafe_updates(opt, params, figures, grad_scale=scale) == []
        planned = planned_bounds(opt, params, figures, grad_scale=scale) if variant != "main" else []
        if variant in ("blocked", "fused"):  # the trainer's update: blocks, or the fused kernel clipping inside
            sums = apply_step(opt, params, grad_scale=scale, checksum=True)
            assert len(sums) == (3 * len(params) if variant == "blocked" else 0)
            if not sums:  # the fused kernel takes no checksums: the replica check reads them
                checksums([*params, *moments(opt)[0], *moments(opt)[1]])
        else:
            for p in params:
                p.grad.mul_(scale)
            opt.step()
            checksums([*params, *moments(opt)[0], *moments(opt)[1]])
        if variant != "main":
            carry_bounds(bounds, opt, params, planned)

    for opt in (optimizer, fused):
        fresh_grads()
        opt.step()  # the moments exist
    times: dict[str, list[float]] = {
        "adamw": [],
        "main": [],
        "lean": [],
        "blocked": [],
        "fused kernel": [],
        "fused": [],
    }
    for _ in range(rounds):
        for name in times:
            fresh_grads()
            if name in ("lean", "blocked"):  # the other variants moved the weights: bounds as a step before leaves
                record_exact_bounds(known, optimizer, params)  # (untimed)
            if name == "fused":
                record_exact_bounds(known_fused, fused, params)
            start = time.perf_counter()
            if name == "adamw":
                optimizer.step()
            elif name == "fused kernel":
                fused.step()
            else:
                step(name)
            times[name].append(time.perf_counter() - start)
    print(f"SmolLM2-135M float32, one process x 1 thread, {rounds} interleaved rounds: (step reads + AdamW) / AdamW")
    adamw = times["adamw"]
    variants = (("main", "8 reads"), ("lean", "5 reads"), ("blocked", "1 read + blocks"), ("fused kernel", "0 reads"))
    for name, reads in (*variants, ("fused", "4 reads")):
        paired = [t / a for t, a in zip(times[name], adamw, strict=True)]  # the same round: the same load
        print(
            f"  {name} ({reads} per parameter besides AdamW's): fastest {min(times[name]):.2f} s / AdamW's "
            f"fastest {min(adamw):.2f} s = {min(times[name]) / min(adamw):.2f} x; "
            f"medians {statistics.median(times[name]) / statistics.median(adamw):.2f} x; "
            f"per round: min {min(paired):.2f} x, median {statistics.median(paired):.2f} x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration (the first is not counted)")
    parser.add_argument("--tokens", type=int, default=256, help="per-rank token budget of a microbatch")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--interleaved", type=int, default=0, help="only the in-process before/after rounds")
    args = parser.parse_args()
    if args.interleaved:
        interleaved(args.interleaved)
        return
    import lean_step as bench  # this file by its module name: the ranks look the case up by module and name

    print(f"SmolLM2-135M float32, 2 gloo ranks x 1 thread, {args.tokens} tokens per rank per microbatch")
    for cp in args.cp:
        pool = RankPool(2, timeout=3600)
        try:
            r = pool.run(bench.measure, cp=cp, tokens=args.tokens, steps=args.steps)[0]
        finally:
            pool.close()
        print(
            f"  CP={cp} DP={2 // cp}: {r['parameter_tensors']:.0f} parameter tensors\n"
            f"    per optim_step: {r['step_syncs']:.0f} host syncs ({r['update_syncs']:.0f} of them inside the update: "
            f"torch's per-tensor AdamW reads its step count per call on the CPU, the fused kernel none; "
            f"{r['step_syncs_outside_update']:.0f} outside), {r['step_collectives']:.0f} "
            f"collectives ({r['collective_s']:.2f} s; the gradient reduction with its check {r['reduce_s']:.2f} s)\n"
            f"    per microbatch: {r['mb_syncs_first']:.0f} host syncs (the last of {r['microbatches']:.0f}, with the "
            f"request's tail: {r['mb_syncs_last']:.0f}), {r['mb_collectives_first']:.0f} collectives (the last: "
            f"{r['mb_collectives_last']:.0f})\n"
            f"    gradient buckets reduced during the last backward: {r['buckets_in_backward']:.0f} of "
            f"{r['buckets']:.0f} (the rest launched after it), waited for at the request's end "
            f"{r['overlap_wait_s']:.2f} s; forward_backward {r['forward_backward_s']:.2f} s\n"
            f"    optim_step {r['optim_step_s']:.2f} s, less the reduction and collectives {r['optimizer_s']:.2f} s = "
            f"{r['optimizer_over_plain']:.2f} x a plain AdamW step after it ({r['plain_adamw_s']:.2f} s); of it the "
            f"update (clipping, AdamW, the checksums taken on the way) {r['update_in_step_s']:.2f} s, the replica "
            f"check {r['replica_check_s']:.2f} s\n"
            + (
                f"    over torch.optim.AdamW(params).step() as a user runs it (its CPU per-tensor loop): "
                f"{r['optimizer_over_user']:.2f} x ({r['user_adamw_s']:.2f} s)\n"
                if math.isfinite(r["user_adamw_s"])
                else ""
            )
            + f"    host syncs of the last optim_step by call site: {r['sites']}"
        )


if __name__ == "__main__":
    main()
