"""``ringtune plan`` against measurement: predicted vs measured per-rank peak of real training steps on CPU.

Run ``python benchmarks/plan_check.py [--configs 1:none:8192 2:full:16384 4:selective:16384 2:full:16384:dp_cp]``.

Each configuration ``CP:recompute:tokens[:shard]`` (``shard`` a name of ``ringtune serve --shard-params``, default
``none``; ``dp_cp`` shards over the CP ranks here) runs in fresh gloo ranks (:func:`ringtune.parallel.spawn`): the
benchmark model of ``long_rows.py`` (hidden 256, 3 GatedDeltaNet + 1 attention layers, vocab 32K, float32)
under :class:`ringtune.engine.Trainer` on a DP=1 × CP mesh; a warm-up step (a 256-token datum,
forward_backward + optim_step) creates the AdamW moments, then one step of one ``tokens``-token datum
(cross_entropy forward_backward + optim_step) is measured as ``long_rows.py`` measures it: peak live CPU
tensor bytes allocated during the step (torch.profiler memory events), to which the bytes already live
before it (parameters and AdamW moments, counted from the tensors) are added. The prediction is
:func:`ringtune.plan.estimate.estimate` for the rank's token count (max over ranks of both). Goal: every
ratio predicted / measured within 1 ± 0.10. Prints one line per configuration and PASS/FAIL.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from attention_cp import MIB, _quiet_stderr
from gated_delta_cp import fix_mmap_threshold
from long_rows import MODEL, build_model, describe_model
from torch.distributed.tensor import DTensor

from ringtune.engine.batch import TrainDatum
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import Trainer
from ringtune.layout.budget import rank_token_budget
from ringtune.models.config import DecoderConfig
from ringtune.parallel import spawn
from ringtune.parallel.mesh import build_mesh
from ringtune.plan.estimate import Layout, estimate
from ringtune.testing.profiled_memory import allocation_events

GOAL = 0.10
ADAM = AdamParams(learning_rate=1e-5)
DEFAULT_CONFIGS = ["1:none:8192", "2:full:16384", "4:selective:16384", "2:full:16384:dp_cp"]


def _datum(n: int, seed: int) -> TrainDatum:
    gen = torch.Generator().manual_seed(seed)
    vocab = MODEL["vocab_size"]
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    inputs = {
        "target_tokens": torch.randint(0, vocab, (n,), generator=gen),
        "weights": torch.ones(n, dtype=torch.float64),
    }
    return TrainDatum(tokens=tokens, inputs=inputs)


def _live_bytes(trainer: Trainer) -> int:
    """Bytes of the parameters and the optimizer state (distinct storages; a sharded tensor's local shard) live
    before the measured step."""
    seen: dict[int, int] = {}
    tensors = list(trainer.model.parameters())
    for state in trainer.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def step_worker(rank: int, tokens: int, recompute: str, shard: str) -> dict[str, Any]:
    """One measured training step on this rank (world = CP); see the module docstring."""
    fix_mmap_threshold()
    cp = dist.get_world_size()
    mesh = build_mesh(dp=1, cp=cp)
    budget = rank_token_budget(tokens, cp, pad_multiplier=8)
    heads = (MODEL["linear_num_key_heads"], MODEL["linear_num_value_heads"])
    gdn = "headwise" if all(h % cp == 0 for h in heads) else "chunkwise"  # as the planner assumes
    modes = {"recompute": recompute, "gated_delta": gdn, "shard_params": shard}
    trainer = Trainer(build_model(), mesh, max_tokens_per_rank=budget, **modes)
    trainer.forward_backward([_datum(256, 1)], "cross_entropy")
    trainer.optim_step(ADAM)
    gc.collect()
    before = _live_bytes(trainer)
    dist.barrier()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    start = time.perf_counter()
    trainer.forward_backward([_datum(tokens, 2)], "cross_entropy")
    trainer.optim_step(ADAM)
    seconds = time.perf_counter() - start
    with _quiet_stderr():
        prof.stop()
    events = allocation_events(prof)
    batch = trainer.build_batch([_datum(tokens, 2)], "cross_entropy", None)
    return {
        "step_peak": max(total for _, _, total in events),
        "before": before,
        "local_len": batch.plan.local_lens[0][0],
        "seconds": seconds,
        "gated_delta": gdn,
    }


def check(cp: int, recompute: str, tokens: int, shard: str = "none") -> tuple[bool, str]:
    results = spawn(step_worker, cp, tokens, recompute, shard)
    measured = max(r["step_peak"] + r["before"] for r in results)
    local = max(r["local_len"] for r in results)
    cfg = DecoderConfig.from_hf(MODEL)
    est = estimate(cfg, Layout(cp=cp, dp=1, shard=shard, recompute=recompute, precision="float32"), local)
    ratio = est.peak / measured
    ok = abs(ratio - 1) <= GOAL
    line = (
        f"    CP={cp} {recompute:<9} {shard:<5} {results[0]['gated_delta']:<9} {tokens:>6} {local:>6}"
        f" {est.peak / MIB:9.1f} {measured / MIB:9.1f} {ratio:6.3f}"
        f"  {est.phase:<9} {max(r['seconds'] for r in results):6.1f}  {'PASS' if ok else 'FAIL'}"
    )
    return ok, line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="CP:recompute:tokens[:shard]")
    args = p.parse_args(argv)
    start = time.perf_counter()
    print(f"ringtune plan check: torch {torch.__version__}; model: {describe_model()}")
    print(f"per-rank peak of forward_backward + optim_step, MiB (max over ranks); goal |ratio - 1| <= {GOAL}")
    print(
        f"    {'config':<15} {'shard':<5} {'GDN':<9} {'tokens':>6} {'local':>6} {'predicted':>9} {'measured':>9}"
        f" {'ratio':>6}  {'phase':<9} {'s':>6}"
    )
    ok = []
    for spec in args.configs:
        cp, recompute, tokens, *shard = spec.split(":")
        good, line = check(int(cp), recompute, int(tokens), *shard)
        ok.append(good)
        print(line, flush=True)
    print(f"\n{sum(ok)}/{len(ok)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
