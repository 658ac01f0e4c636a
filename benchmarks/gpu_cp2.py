"""CP=2 on one device (two processes sharing it) against CP=1 on the same data (part of ``gpu_check.py``).

Both runs build the same random Qwen3.5-shaped model (seeded, weights N(0, 0.02)) in bf16-mixed on the same device
and run one forward + backward of one packed row (sequences of 1, odd and chunk-crossing lengths) with the default
CP modes (ring attention, headwise GatedDeltaNet), then (on CUDA) again with ``--linear-cp-mode fla_cp`` (fla's own
context parallelism, ``ops/gated_delta/cp_fla.py``; skipped, with the reason, where fla is missing). Compared: the
row's label log-probs (mean and p99 of |Δ|) and the global gradient norm (|gn₂/gn₁ − 1|) against the bf16 parity
limits of docs/parity.md (``ringtune.parity.compare.LIMITS["bf16-mixed"]``: lp mean 1e-3, p99 5e-3, grad norm
5e-3).

The data groups take ``backend``: ``gloo`` on CPU; on CUDA ``nccl`` first, then ``gloo``. NCCL refuses two ranks
on one GPU ("Duplicate GPU detected", ncclInvalidUsage, in the NCCL versions users report it from); that reason is
recorded and the check goes on with a gloo group, whose collectives and ring exchanges ringtune then stages through
host memory (``ringtune.parallel.collectives.host_staged``: the same device arithmetic, slower transport; checked
on CPU by ``tests/test_models_cp.py::test_host_staged_collectives_equal_cp1_float64``). ``python gpu_cp2.py
--device cuda`` runs the check alone and prints its JSON (``gpu_check.py`` runs it so, under a timeout, so that a
hung collective cannot eat the whole run). NOT YET RUN ON A GPU.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist

from ringtune.layout.zigzag import zigzag_slice
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.models.precision import set_compute_dtype
from ringtune.models.shard import shard_of
from ringtune.parallel import spawn
from ringtune.parallel.collectives import all_reduce_
from ringtune.parallel.row_gather import gather_row
from ringtune.parity.compare import LIMITS

SEQ_LENS = (1, 37, 160, 5, 301)


def cp_worker(
    rank: int, cfg: dict[str, Any], device: str, backend: str, seq_lens: tuple[int, ...], gated_delta: str = "headwise"
) -> dict:
    """One rank: the row's log-probs (row order, float64 list) and the global grad norm (CP-summed gradients);
    GatedDeltaNet layers by CP mode ``gated_delta``."""
    world = dist.get_world_size()
    dev = torch.device(device)
    group = None
    if world > 1:
        group = dist.new_group(list(range(world)), backend=backend) if backend != "gloo" else dist.group.WORLD
    torch.manual_seed(0)
    model = CausalLM(DecoderConfig.from_hf(cfg))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model = model.to(dev)
    set_compute_dtype(model, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    row = torch.randint(0, cfg["vocab_size"], (sum(seq_lens),), generator=gen)
    labels, start = torch.full_like(row, -100), 0
    for n in seq_lens:
        labels[start : start + n - 1] = row[start + 1 : start + n]
        start += n
    shard = shard_of(seq_lens, cp_size=world, cp_rank=rank, group=group, gated_delta=gated_delta)
    ids = zigzag_slice(row, shard.plan).to(dev)
    lab = zigzag_slice(labels, shard.plan, pad_value=-100).to(dev)
    lp = model(ids, shard, lab)
    (-lp.sum()).backward()
    grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
    if group is not None:
        all_reduce_(grads, group)
    full = gather_row(lp.detach().float(), shard.plan, group)
    return {"lp": full.double().cpu().tolist(), "grad_norm": float(grads.norm())}


def cp2_parity(cfg: dict[str, Any], device: torch.device, report=None) -> dict:
    """Run CP=1 and CP=2 (each in fresh processes) on ``device``; the figures and their limits. ``report(result)``
    after each backend that fails (so a later hang still leaves what was learnt)."""
    limits = LIMITS["bf16-mixed"]
    backends = ["nccl", "gloo"] if device.type == "cuda" else ["gloo"]
    ref = spawn(cp_worker, 1, cfg, str(device), "gloo", SEQ_LENS, threads=1)[0]
    attempts = []
    for backend in backends:
        try:
            got = spawn(cp_worker, 2, cfg, str(device), backend, SEQ_LENS, threads=1)[0]
        except RuntimeError as exc:
            attempts.append(f"{backend}: {str(exc).strip().splitlines()[-1][:200]}")
            if report is not None:
                report({"backend": None, "pass": False, "failed_backends": list(attempts)})
            continue
        figures, lim = _figures(ref, got, limits, "")
        result = {"backend": backend, "figures": figures, "limits": lim, "failed_backends": attempts}
        result["pass"] = all(figures[k] <= lim[k] for k in figures)
        if device.type == "cuda":
            if report is not None:  # the default modes' figures survive a hang of the fla_cp run
                report(result)
            _add_fla_cp(result, cfg, device, backend, ref, limits)
        return result
    return {"backend": None, "pass": False, "failed_backends": attempts}


def _figures(ref: dict, got: dict, limits, prefix: str) -> tuple[dict[str, float], dict[str, float]]:
    """(figures, limits) of CP=2 ``got`` against CP=1 ``ref``, keys prefixed by ``prefix``."""
    a, b = torch.tensor(ref["lp"]), torch.tensor(got["lp"])
    diff = (a - b).abs()
    figures = {
        "lp_mean": float(diff.mean()),
        "lp_p99": float(diff.quantile(0.99)),
        "grad_norm_rel": abs(got["grad_norm"] / ref["grad_norm"] - 1),
    }
    lim = {"lp_mean": limits.lp_mean, "lp_p99": limits.lp_p99, "grad_norm_rel": limits.grad_norm}
    return {prefix + k: v for k, v in figures.items()}, {prefix + k: v for k, v in lim.items()}


def _add_fla_cp(result: dict, cfg: dict[str, Any], device: torch.device, backend: str, ref: dict, limits) -> None:
    """CP=2 again with GatedDeltaNet by ``fla_cp`` on ``backend``; its figures join ``result`` (and its pass), or
    the reason it could not run joins ``failed_backends``."""
    from ringtune.ops.cp_modes import fla_cp_unavailable_reason

    reason = fla_cp_unavailable_reason()
    if reason is not None:
        result["failed_backends"].append(f"fla_cp not run: {reason}")
        return
    try:
        got = spawn(cp_worker, 2, cfg, str(device), backend, SEQ_LENS, "fla_cp", threads=1)[0]
    except RuntimeError as exc:
        result["failed_backends"].append(f"fla_cp on {backend}: {str(exc).strip().splitlines()[-1][:200]}")
        result["pass"] = False
        return
    figures, lim = _figures(ref, got, limits, "fla_cp ")
    result["figures"] |= figures
    result["limits"] |= lim
    result["pass"] = result["pass"] and all(figures[k] <= lim[k] for k in figures)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=512)
    a = p.parse_args()
    from gpu_step import SMOKE_MODEL

    cfg = {**SMOKE_MODEL, "hidden_size": a.hidden, "head_dim": 64}
    progress = lambda r: print(json.dumps(r), flush=True)  # noqa: E731 - one JSON line per step
    print(json.dumps(cp2_parity(cfg, torch.device(a.device), progress)), flush=True)


if __name__ == "__main__":
    main()
