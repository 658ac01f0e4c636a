"""``ringtune plan`` against measurement: predicted vs measured per-rank peak of real training steps on CPU.

Run ``python benchmarks/plan_check.py [--configs 1:none:8192 2:full:16384 4:selective:16384 2:full:16384:dp_cp]``
or, for a MoE model, ``python benchmarks/plan_check.py --moe [--configs 1:none:8192:none:1 2:none:8192:none:2 ...]``.

Each configuration ``CP:recompute:tokens[:shard[:ep]]`` (``shard`` a name of ``ringtune serve --shard-params``,
default ``none``; ``dp_cp`` shards over the CP ranks here; ``ep`` the expert parallelism of ``--moe``, default 1)
runs in fresh gloo ranks (:func:`ringtune.parallel.spawn`): the benchmark model of ``long_rows.py`` (hidden 256,
3 GatedDeltaNet + 1 attention layers, vocab 32K, float32; with ``--moe`` its Qwen3.5-MoE twin: every MLP a sparse
MoE of 16 experts, top-2, expert width 256, a shared expert of 512, routers drawn at std 0.5)
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
from pathlib import Path
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
from ringtune.models.decoder import CausalLM
from ringtune.models.layers.moe import moe_blocks
from ringtune.models.precision import check_precision
from ringtune.parallel import spawn
from ringtune.parallel.mesh import build_mesh
from ringtune.plan.estimate import Layout, estimate

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import allocation_events

from ringtune.worker.executor import trainer_dtype_options

GOAL = 0.10
ADAM = AdamParams(learning_rate=1e-5)
DEFAULT_CONFIGS = ["1:none:8192", "2:full:16384", "4:selective:16384", "2:full:16384:dp_cp"]
MOE_CONFIGS = ["1:none:8192:none:1", "2:none:8192:none:2", "4:selective:16384:none:4", "4:full:16384:none:2"]
MOE_MODEL: dict[str, Any] = {
    **{k: v for k, v in MODEL.items() if k != "intermediate_size"},
    "model_type": "qwen3_5_moe_text",
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
}
"""The MoE twin of ``long_rows.MODEL`` (``--moe``)."""


def build_moe_model(seed: int = 0) -> CausalLM:
    """:data:`MOE_MODEL` with random float32 weights, routers at std 0.5 (routing that differs per token)."""
    torch.manual_seed(seed)
    model = CausalLM(DecoderConfig.from_hf(MOE_MODEL))
    with torch.no_grad():
        for block in moe_blocks(model):
            block.gate.weight.normal_(0.0, 0.5)
    return model


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


def step_worker(
    rank: int,
    tokens: int,
    recompute: str,
    shard: str,
    ep: int = 1,
    moe: bool = False,
    precision: str = "float32",
    adamw: str = "torch_default",
) -> dict[str, Any]:
    """One measured training step on this rank (world = CP); see the module docstring."""
    fix_mmap_threshold()
    cp = dist.get_world_size()
    mesh = build_mesh(dp=1, cp=cp, ep=ep)
    budget = rank_token_budget(tokens, cp, pad_multiplier=8)
    heads = (MODEL["linear_num_key_heads"], MODEL["linear_num_value_heads"])
    gdn = "headwise" if all(h % cp == 0 for h in heads) else "chunkwise"  # as the planner assumes
    modes = {"recompute": recompute, "gated_delta": gdn, "shard_params": shard, "adamw_kernel": adamw}
    modes |= trainer_dtype_options(check_precision(precision))
    trainer = Trainer(build_moe_model() if moe else build_model(), mesh, max_tokens_per_rank=budget, **modes)
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


def check(
    cp: int,
    recompute: str,
    tokens: int,
    shard: str = "none",
    ep: str = "1",
    moe: bool = False,
    precision: str = "float32",
    adamw: str = "torch_default",
):
    results = spawn(step_worker, cp, tokens, recompute, shard, int(ep), moe, precision, adamw)
    measured = max(r["step_peak"] + r["before"] for r in results)
    local = max(r["local_len"] for r in results)
    cfg = DecoderConfig.from_hf(MOE_MODEL if moe else MODEL)
    layout = Layout(cp=cp, dp=1, shard=shard, recompute=recompute, precision=precision, ep=int(ep))
    est = estimate(cfg, layout, local, adamw=adamw)
    ratio = est.peak / measured
    ok = abs(ratio - 1) <= GOAL
    line = (
        f"    CP={cp} EP={ep} {recompute:<9} {shard:<5} {results[0]['gated_delta']:<9} {tokens:>6} {local:>6}"
        f" {est.peak / MIB:9.1f} {measured / MIB:9.1f} {ratio:6.3f}"
        f"  {est.phase:<9} {max(r['seconds'] for r in results):6.1f}  {'PASS' if ok else 'FAIL'}"
    )
    return ok, line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=None, help="CP:recompute:tokens[:shard[:ep]]")
    p.add_argument("--precision", default="float32", help="the step's precision (float32, bf16-mixed, bfloat16)")
    p.add_argument("--adamw", default="torch_default", help="the trainer's AdamW kernel (torch_default, fused)")
    p.add_argument("--moe", action="store_true", help="the MoE twin of the model (EP from each config)")
    args = p.parse_args(argv)
    configs = args.configs or (MOE_CONFIGS if args.moe else DEFAULT_CONFIGS)
    start = time.perf_counter()
    model = "its Qwen3.5-MoE twin (16 experts, top-2)" if args.moe else "as is"
    print(f"ringtune plan check: torch {torch.__version__}; model: {describe_model()}; {model}")
    print(f"per-rank peak of forward_backward + optim_step, MiB (max over ranks); goal |ratio - 1| <= {GOAL}")
    print(
        f"    {'config':<15} {'shard':<5} {'GDN':<9} {'tokens':>6} {'local':>6} {'predicted':>9} {'measured':>9}"
        f" {'ratio':>6}  {'phase':<9} {'s':>6}"
    )
    ok = []
    for spec in configs:
        cp, recompute, tokens, *rest = spec.split(":")
        good, line = check(
            int(cp), recompute, int(tokens), *rest, moe=args.moe, precision=args.precision, adamw=args.adamw
        )
        ok.append(good)
        print(line, flush=True)
    print(f"\n{sum(ok)}/{len(ok)} checks PASS, {time.perf_counter() - start:.0f} s")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
