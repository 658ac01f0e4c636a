"""Long prompts on the mesh: per-rank peak memory and time of a prompt's forward at CP = 1, 2, 4.

Run ``python benchmarks/long_prompt.py [--tokens 16384] [--cps 1 2 4]``. Every figure is a ratio measured in
this one run (the machine is shared). On :data:`long_rows.MODEL` (Qwen3.5-shaped, hidden 256, 3 GatedDeltaNet
+ 1 attention layers, vocab 32K, float32) and one prompt of ``--tokens`` tokens:

- ``one-rank prefill``: what a rank does for a short prompt (``sample.prefill.prefill`` with its cache
  capture, prompt log-probs on), the reference;
- ``mesh logprobs``: ``sample.mesh_prompts.prompts_forward`` without capture (``compute_logprobs``) at each
  CP size;
- ``mesh prefill``: the same with the decode caches gathered to the rank that decodes the prompt.

Per run: the peak live tensor bytes of each rank during the call (torch.profiler memory events; the
largest rank is shown) and the wall time (slowest rank). Goal: the mesh's per-rank peak at CP = 4 is at most
half the one-rank prefill's for ``compute_logprobs`` (the caches of ``mesh prefill`` end on one rank, so its
peak keeps the whole cache on that rank).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from attention_cp import MIB, _quiet_stderr, verdict
from gated_delta_cp import fix_mmap_threshold
from long_rows import build_model, describe_model

from ringtune.parallel import spawn
from ringtune.parallel.mesh import build_mesh
from ringtune.sample.mesh_prompts import MeshLayout, prompts_forward
from ringtune.sample.prefill import prefill

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.profiled_memory import tensor_peak_bytes

GOAL = 0.5
"""CP=4 ``compute_logprobs`` per-rank peak over the one-rank prefill's."""


def _measure(fn) -> tuple[int, float]:
    """(peak live tensor bytes above the start, seconds) of ``fn()``."""
    gc.collect()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    with _quiet_stderr():
        prof.stop()
    return tensor_peak_bytes(prof), seconds


def worker(rank: int, tokens: int, kinds: list[str]) -> dict[str, tuple[int, float]]:
    """Every kind of run on this rank's share of one ``tokens``-token prompt; {kind: (peak bytes, seconds)}."""
    fix_mmap_threshold()
    cp = dist.get_world_size()
    mesh = build_mesh(dp=1, cp=cp)
    model = build_model()
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(tokens)
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), generator=gen).tolist()
    layout = MeshLayout(max_tokens_per_rank=tokens, attention="ring", gated_delta="chunkwise")
    runs = {
        "one-rank prefill": lambda: prefill(model, [prompt], prompt_logprobs=True),
        "mesh logprobs": lambda: prompts_forward(model, mesh, [prompt], layout, prompt_logprobs=True),
        "mesh prefill": lambda: prompts_forward(model, mesh, [prompt], layout, prompt_logprobs=True, capture=True),
    }
    warm = torch.randint(0, model.config.vocab_size, (256,), generator=gen).tolist()
    with torch.inference_mode():
        prompts_forward(model, mesh, [warm], layout, prompt_logprobs=True, capture=True)
    out = {}
    for kind in kinds:
        dist.barrier()
        with torch.inference_mode():
            out[kind] = _measure(runs[kind])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    print(f"model: {describe_model()}; one prompt of {args.tokens} tokens")
    table: dict[tuple[str, int], tuple[int, float]] = {}
    for cp in args.cps:
        kinds = ["mesh logprobs", "mesh prefill"] + (["one-rank prefill"] if cp == 1 else [])
        per_rank = spawn(worker, cp, args.tokens, kinds)
        for kind in kinds:
            table[kind, cp] = (max(r[kind][0] for r in per_rank), max(r[kind][1] for r in per_rank))
    ref_bytes, ref_s = table["one-rank prefill", 1]
    print(f"{'run':<18}{'CP':>4}{'peak MiB/rank':>15}{'vs one-rank':>13}{'seconds':>10}{'vs one-rank':>13}")
    for (kind, cp), (nbytes, seconds) in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        print(
            f"{kind:<18}{cp:>4}{nbytes / MIB:>15.1f}{nbytes / ref_bytes:>13.3f}{seconds:>10.2f}{seconds / ref_s:>13.3f}"
        )
    ok = True
    if ("mesh logprobs", 4) in table:
        ratio = table["mesh logprobs", 4][0] / ref_bytes
        print(
            f"CP=4 compute_logprobs per-rank peak / one-rank prefill = {ratio:.3f} (goal <= {GOAL}): "
            f"{verdict(ratio, GOAL)}"
        )
        ok = ratio <= GOAL
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
