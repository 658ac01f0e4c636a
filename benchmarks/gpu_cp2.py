"""CP=2 on one device (two processes sharing it) against CP=1 on the same data (part of ``gpu_check.py``).

Both runs build the same random Qwen3.5-shaped model (seeded, weights N(0, 0.02)) in bf16-mixed on the same device
and run one forward + backward of one packed row (sequences of 1, odd and chunk-crossing lengths) with the default
CP modes (ring attention, headwise GatedDeltaNet). Compared: the row's label log-probs (mean and p99 of |Δ|) and
the global gradient norm (|gn₂/gn₁ − 1|) against the bf16 parity limits of docs/parity.md (``ringtune.parity.compare
.LIMITS["bf16-mixed"]``: lp mean 1e-3, p99 5e-3, grad norm 5e-3).

The data groups take ``backend``: ``gloo`` on CPU; on CUDA ``nccl`` first. NCCL refuses two ranks on one GPU on
some versions ("Duplicate GPU detected"); the check then says so and tries gloo with CUDA tensors, which only some
gloo builds accept. NOT YET RUN ON A GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringtune.engine.gather import gather_row
from ringtune.layout.zigzag import zigzag_slice
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.models.precision import set_compute_dtype
from ringtune.models.shard import shard_of
from ringtune.parallel import spawn
from ringtune.parity.compare import LIMITS

SEQ_LENS = (1, 37, 160, 5, 301)


def cp_worker(rank: int, cfg: dict[str, Any], device: str, backend: str, seq_lens: tuple[int, ...]) -> dict:
    """One rank: the row's log-probs (row order, float64 list) and the global grad norm (CP-summed gradients)."""
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
    shard = shard_of(seq_lens, cp_size=world, cp_rank=rank, group=group)
    ids = zigzag_slice(row, shard.plan).to(dev)
    lab = zigzag_slice(labels, shard.plan, pad_value=-100).to(dev)
    lp = model(ids, shard, lab)
    (-lp.sum()).backward()
    grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
    if group is not None:
        dist.all_reduce(grads, group=group)
    full = gather_row(lp.detach().float(), shard.plan, group)
    return {"lp": full.double().cpu().tolist(), "grad_norm": float(grads.norm())}


def cp2_parity(cfg: dict[str, Any], device: torch.device) -> dict:
    """Run CP=1 and CP=2 (each in fresh processes) on ``device``; the figures and their limits."""
    limits = LIMITS["bf16-mixed"]
    backends = ["nccl", "gloo"] if device.type == "cuda" else ["gloo"]
    ref = spawn(cp_worker, 1, cfg, str(device), "gloo", SEQ_LENS, threads=1)[0]
    attempts = []
    for backend in backends:
        try:
            got = spawn(cp_worker, 2, cfg, str(device), backend, SEQ_LENS, threads=1)[0]
        except RuntimeError as exc:
            attempts.append(f"{backend}: {str(exc).strip().splitlines()[-1][:200]}")
            continue
        a, b = torch.tensor(ref["lp"]), torch.tensor(got["lp"])
        diff = (a - b).abs()
        figures = {
            "lp_mean": float(diff.mean()),
            "lp_p99": float(diff.quantile(0.99)),
            "grad_norm_rel": abs(got["grad_norm"] / ref["grad_norm"] - 1),
        }
        lim = {"lp_mean": limits.lp_mean, "lp_p99": limits.lp_p99, "grad_norm_rel": limits.grad_norm}
        ok = all(figures[k] <= lim[k] for k in figures)
        return {"backend": backend, "figures": figures, "limits": lim, "pass": ok, "failed_backends": attempts}
    return {"backend": None, "pass": False, "failed_backends": attempts}
