"""``ringtune probe``: the layer gradient probe at each CP size and mode; a table and an exit status.

Each CP size runs in its own world of C gloo ranks (spawned here, or the torchrun world when launched by
torchrun). Rank 0 also runs the no-CP reference and compares; the other ranks only run their shards.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ringtune.errors import ParallelConfigError
from ringtune.layout.zigzag import zigzag_slice
from ringtune.models.layers.moe import is_expert_parameter, set_expert_parallel
from ringtune.models.shard import shard_of
from ringtune.ops.cp_modes import ATTENTION_MODES, GATED_DELTA_MODES
from ringtune.parallel.collectives import all_reduce_
from ringtune.parallel.launch import init_from_env, spawn
from ringtune.probes.layer_probe import (
    MOE_MODES,
    ProbeSizes,
    build_layers,
    cosine,
    logit_std,
    loss_mask,
    low_rows,
    norm_ratio,
    probe_inputs,
    probe_row,
    row_order,
)
from ringtune.probes.vision_probe import VISION_MODES, vision_entry

# Pass limits per dtype: (min cosine, max |norm ratio - 1|, max share of compared rows below cosine 0.99).
# CP and no CP run the same dtype and differ only in summation order: float64 agrees to ~1e-13; float32
# to ~1e-6 relative; bfloat16 rounds every layer input/output (8 bits of mantissa, ~4e-3 relative per
# op), so whole-tensor cosines stay above 0.999 and single rows may dip, most of all rows of tiny norm.
LIMITS = {"float64": (1 - 1e-10, 1e-8, 0.0), "float32": (0.9999, 1e-3, 0.0), "bfloat16": (0.99, 0.03, 0.01)}
MODES = {"gdn": GATED_DELTA_MODES, "attention": ATTENTION_MODES, "moe": MOE_MODES, "vision": VISION_MODES}
# The vision tower's CP run repeats the reference's per-image computation (whole images, the same ops) and differs
# only in which images share a matmul and the order the ranks' gradient partials are summed: float64 within
# 1e-10 of the largest reference element (the issue's bar; measured 1.8e-15); float32 within 1e-5 (measured
# 1.2e-6: tens of float32 ulps of 6e-8 from matmuls over other image batches and the CP sum of partials, with
# margin). bfloat16 is held to the cosine limits above only: every op rounds to 4e-3, and the small, cancelling
# sums of the LayerNorm bias gradients differ by several % of their largest element (measured 6.5e-2).
VISION_MAX_REL_DIFF: dict[str, float | None] = {"float64": 1e-10, "float32": 1e-5, "bfloat16": None}


@dataclass(frozen=True, kw_only=True)
class LayerProbeConfig:
    """What ``ringtune probe`` runs; one field per flag."""

    cps: tuple[int, ...] = (2, 4, 8)
    layers: tuple[str, ...] = ("gdn", "attention", "moe", "vision")
    gdn_modes: tuple[str, ...] = MODES["gdn"]
    attention_modes: tuple[str, ...] = MODES["attention"]
    moe_modes: tuple[str, ...] = MODES["moe"]
    dtype: str = "bfloat16"
    tokens: int = 4096
    sizes: ProbeSizes = field(default_factory=ProbeSizes)
    attention_sharpness: float | None = None
    seed: int = 0


def _grads(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in layer.named_parameters()
    }


def _before_split(seq_lens: tuple[int, ...], datum: int, split: int) -> slice:
    """Row slice of the straddling datum's tokens before the split (they hold no loss weight)."""
    start = sum(seq_lens[:datum])
    return slice(start, start + split)


def _run_shard(layer, x_row, w_row, mask, shard):
    """Forward + backward of ``layer`` on ``shard`` of the row: (out, input leaf, param grads), grads cleared."""
    plan = shard.plan
    x = zigzag_slice(x_row, plan).requires_grad_()
    out = layer(x, shard)
    weights = zigzag_slice(w_row * mask[:, None].to(w_row.dtype), plan)
    (out * weights).float().sum().backward()
    grads = _grads(layer)
    layer.zero_grad(set_to_none=True)
    return out, x, grads


def _reference(layer, x_row, w_row, mask, seq_lens):
    """No-CP run of the whole row: (out rows, input-grad rows, param grads)."""
    shard = shard_of(seq_lens)
    out, x, grads = _run_shard(layer, x_row, w_row, mask, shard)
    return row_order(out, [shard.plan], [out.detach()]), row_order(x, [shard.plan], [x.grad]), grads


def _cp_run(layer, x_row, w_row, mask, seq_lens, cp, rank, group, kind, mode):
    """This rank's CP run; out and input grad gathered to row order, param grads summed over ``group`` (the
    experts of an ``expert_parallel`` MoE, split over ``group``, gathered back to every expert instead)."""
    kwargs = {"attention": mode} if kind == "attention" else {"gated_delta": mode} if kind == "gdn" else {}
    shard = shard_of(seq_lens, cp_size=cp, cp_rank=rank, group=group, **kwargs)
    plan = shard.plan
    if kind == "moe" and mode == "expert_parallel":
        layer = copy.deepcopy(layer)
        set_expert_parallel(layer, group)
    out, x, grads = _run_shard(layer, x_row, w_row, mask, shard)
    for name, g in grads.items():
        if kind == "moe" and mode == "expert_parallel" and is_expert_parameter(name):
            parts = [torch.empty_like(g) for _ in range(cp)]
            dist.all_gather(parts, g.contiguous(), group=group)
            grads[name] = torch.cat(parts)
        else:
            all_reduce_(g, group)
    plans = [plan.for_rank(r) for r in range(cp)]
    rows = []
    for local in (out.detach(), x.grad):
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        rows.append(row_order(local, plans, parts))
    return rows[0], rows[1], grads


def probe_world(rank: int, config: LayerProbeConfig, cp: int) -> list[dict] | None:
    """Run every layer and mode at CP ``cp`` on this rank of the world (size ``cp``); rank 0 returns rows."""
    group = dist.group.WORLD
    dtype = getattr(torch, config.dtype)
    seq_lens = probe_row(config.tokens, config.seed)
    layers = (
        build_layers(config.sizes, dtype=dtype, seed=config.seed, sharpness=config.attention_sharpness)
        if set(config.layers) - {"vision"}
        else {}
    )
    hidden = config.sizes.scaled(config.sizes.hidden)
    x_row, w_row = probe_inputs(config.tokens, hidden, dtype=dtype, seed=config.seed)
    mask, datum, split = loss_mask(seq_lens, cp)
    report = []
    for kind in config.layers:
        if kind == "vision":  # its own row (images) and tower: ringtune.probes.vision_probe
            report.append(vision_entry(rank, cp, group, dtype=dtype, seed=config.seed, cps=config.cps))
            continue
        layer = layers[kind]
        ref = _reference(layer, x_row, w_row, mask, seq_lens) if rank == 0 else None
        modes = {"gdn": config.gdn_modes, "attention": config.attention_modes, "moe": config.moe_modes}[kind]
        for mode in modes:
            entry = {"layer": kind, "mode": mode, "cp": cp, "datum": datum, "split": split}
            try:
                layer.check_cp(cp, mode)
            except ParallelConfigError as err:
                entry["skipped"] = str(err)
                report.append(entry)
                continue
            out, dx, grads = _cp_run(layer, x_row, w_row, mask, seq_lens, cp, rank, group, kind, mode)
            if rank == 0:
                entry["metrics"] = {"out": (cosine(out, ref[0]), norm_ratio(out, ref[0]))}
                entry["metrics"]["input grad"] = (cosine(dx, ref[1]), norm_ratio(dx, ref[1]))
                before = _before_split(seq_lens, datum, split)  # reaches the loss only across ranks
                entry["metrics"]["input grad pre-split"] = (
                    cosine(dx[before], ref[1][before]),
                    norm_ratio(dx[before], ref[1][before]),
                )
                for name, g in grads.items():
                    entry["metrics"][name] = (cosine(g, ref[2][name]), norm_ratio(g, ref[2][name]))
                entry["low_rows"] = {
                    "out": low_rows(out, ref[0], seq_lens, cp),
                    "input grad": low_rows(dx, ref[1], seq_lens, cp),
                }
            report.append(entry)
    if rank == 0 and "attention" in config.layers:
        report.append({"logit_std": logit_std(layers["attention"], x_row)})
    return report if rank == 0 else None


def _print_entry(entry: dict, limits: tuple[float, float, float], dtype: str) -> bool:
    min_cos, max_norm, max_low = limits
    head = f"{entry['layer']:<9} {entry['mode']:<9} C={entry['cp']}"
    if "skipped" in entry:
        print(f"{head}  n/a: {entry['skipped']}")
        return True
    ok = True
    if "images" in entry:
        images, shared, sequences = entry["images"]
        limit = VISION_MAX_REL_DIFF[dtype]
        good = limit is None or entry["max_rel_diff"] <= limit
        ok &= good
        print(
            f"{head}  {images} images in {sequences} sequences, {shared} on two ranks; max |CP-ref|/max|ref| "
            f"{entry['max_rel_diff']:.1e} (limit {'cosines' if limit is None else f'{limit:.0e}'})  "
            f"{'ok' if good else 'HIGH'}"
        )
    for name, (cos, ratio) in entry["metrics"].items():
        good = cos >= min_cos and abs(ratio - 1) <= max_norm
        ok &= good
        print(
            f"{head}  {name:<22} cosine {cos:.6f} (1-cos {1 - cos:8.1e})  norm ratio {ratio:.6f} "
            f"(ratio-1 {ratio - 1:+8.1e})  {'ok' if good else 'LOW'}"
        )
    for what, (counts, compared) in entry["low_rows"].items():
        total = sum(counts.values())
        good = total <= max_low * compared
        ok &= good
        where = ", ".join(f"datum {i} chunk {c}: {n}" for (i, c), n in sorted(counts.items())[:12])
        print(f"{head}  {what} rows below cosine 0.99: {total} of {compared}{'  (' + where + ')' if where else ''}")
    print(f"{head}  {'PASS' if ok else 'FAIL'}")
    return ok


def run_layer_probe(config: LayerProbeConfig) -> bool:
    """Print the probe's table for every CP size, layer and mode; True when every entry passes."""
    if config.dtype not in LIMITS:
        raise ValueError(f"--dtype must be one of {sorted(LIMITS)}, got {config.dtype!r}")
    reports: list[list[dict]] = []
    if "RANK" in os.environ:  # torchrun: one world, its size is the CP size
        rank = init_from_env(backend="gloo")
        try:
            report = probe_world(rank, config, dist.get_world_size())
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return True
        reports.append(report)
    else:
        for cp in config.cps:
            reports.append(spawn(probe_world, cp, config, cp, threads=1)[0])
    seq_lens = probe_row(config.tokens, config.seed)
    print(f"layer probe: {config.dtype}, {config.tokens} tokens in {len(seq_lens)} datums, vs no CP (same dtype)")
    print(f"config: {dataclasses.asdict(config)}")
    ok = True
    for report in reports:
        for entry in report:
            if "logit_std" in entry:
                print(f"attention logit std (head 0, first 256 tokens): {entry['logit_std']:.3f}")
                continue
            if "split" in entry and entry is report[0]:
                print(f"C={entry['cp']}: loss on datum {entry['datum']} from position {entry['split']} (first split)")
            ok &= _print_entry(entry, LIMITS[config.dtype], config.dtype)
    print("probe PASS" if ok else "probe FAIL")
    return ok
