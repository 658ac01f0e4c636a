"""A Qwen3.5 row with fla's scan (under Triton's interpreter) at CP 1 and CP 2 against ringtune's recompute scan.

One tiny hybrid Qwen3.5 (two GatedDeltaNet layers, key/value heads of 16: fla's ``tl.dot`` needs 16) on a packed
row; every GatedDeltaNet scan goes to ``fla`` (the registry's default is switched in the worker, as a CUDA device
would pick it), float32; last the CP=2 row with ``--linear-cp-mode fla_cp`` (fla's own context parallelism, the
product path of that flag: the model's GatedDeltaNet layers through the registry). Reference: the same model in
float64 with the ``recompute`` scan at CP=1; the float32 ``recompute`` run at CP=1 is the yardstick of float32
rounding. Log-probs and every parameter gradient (summed over the CP group) are compared. Skipped (with the
reason) without the ``triton-cpu`` extra.
"""

from __future__ import annotations

import torch
from support.tiny_models import hf_model

LENS = (20, 1, 33, 10)
LIMIT = 1e-4
"""Relative to max |reference|: float32 kernels over a 64-token row (the float32 ``recompute`` yardstick is printed
beside; measured ~1e-6)."""


def _row_run(model, lens, cp, rank, group, gated_delta):
    """Log-probs in row order [T] and parameter gradients (summed over the CP group) for a fixed weighted loss."""
    import torch.distributed as dist
    from support.tiny_models import next_token_labels, packed_tokens

    from ringtune.layout import zigzag_slice
    from ringtune.models.shard import shard_of

    ids = packed_tokens(lens, model.config.vocab_size, seed=3)
    labels = next_token_labels(ids, lens)
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    shard = shard_of(lens, cp_size=cp, cp_rank=rank, group=group, gated_delta=gated_delta, pad_multiplier=4)
    plan = shard.plan
    lp = model.label_logprobs(zigzag_slice(ids, plan), zigzag_slice(labels, plan, pad_value=-100), shard)
    (lp.double() * zigzag_slice(weights, plan)).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    rows = torch.zeros(len(ids), dtype=torch.float64)
    rows[plan.row_index[plan.is_real]] = lp.detach().double()[plan.is_real]
    if cp > 1:
        for g in grads.values():
            dist.all_reduce(g, group=group)
        dist.all_reduce(rows, group=group)
    return rows, grads


def fla_row_case(ctx, *, root: str):
    import contextlib

    from support.triton_interpreter import fla_cp_on_cpu, interpreted_kernels, interpreter_session

    from ringtune.models.checkpoints.hf import load_hf
    from ringtune.ops.gated_delta import chunked

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=1, cp=2)
    rank, group = mesh.cp_rank, mesh.cp_group
    with contextlib.ExitStack() as stack:
        stack.enter_context(interpreter_session())  # first: torch's own kernels may import triton
        interpreted_kernels("fla.ops.gated_delta_rule")
        ref = _row_run(load_hf(root, dtype=torch.float64), LENS, 1, 0, None, "headwise")
        model = load_hf(root, dtype=torch.float32)
        runs = {"recompute cp1": _row_run(model, LENS, 1, 0, None, "headwise")}
        default, fla_scan, calls = chunked.default_chunk_scan, chunked.CHUNK_SCANS["fla"], []

        def counted_fla_scan(*args, **kwargs):
            calls.append(1)
            return fla_scan(*args, **kwargs)

        chunked.default_chunk_scan = lambda device: "fla"  # what a CUDA device with fla installed gets
        chunked.CHUNK_SCANS["fla"] = counted_fla_scan
        stack.callback(setattr, chunked, "default_chunk_scan", default)
        stack.callback(chunked.CHUNK_SCANS.__setitem__, "fla", fla_scan)
        runs["fla cp1"] = _row_run(model, LENS, 1, 0, None, "headwise")
        for mode in ("headwise", "chunkwise"):
            runs[f"fla cp2 {mode}"] = _row_run(model, LENS, 2, rank, group, mode)
        interpreted_kernels("fla.modules.causal_conv1d", "fla.ops.cp")
        stack.enter_context(fla_cp_on_cpu())
        runs["fla_cp cp2"] = _row_run(model, LENS, 2, rank, group, "fla_cp")  # fla's conv, rule and state chain
    scale_lp = float(ref[0].abs().max())
    errors = {"fla scan calls": (len(calls), 0.0)}
    for name, (rows, grads) in runs.items():
        lp_err = float((rows - ref[0]).abs().max()) / scale_lp
        grad_err = max(float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-30) for n, g in ref[1].items())
        errors[name] = (lp_err, grad_err)
    return errors


def test_qwen35_row_with_fla_scan_at_cp1_and_cp2(tmp_path, interpreted_pool2):
    root = tmp_path / "qwen3_5"
    hf_model("qwen3_5", seed=11, linear_key_head_dim=16, linear_value_head_dim=16).save_pretrained(root)
    per_rank = interpreted_pool2.run(fla_row_case, root=str(root))
    for rank, errors in enumerate(per_rank):
        calls, _ = errors.pop("fla scan calls")
        assert calls >= 2 * 3, (rank, calls)  # two GatedDeltaNet layers in each of the three fla runs
        for name, (lp_err, grad_err) in errors.items():
            if rank == 0:
                print(f"{name}: log-prob max |Δ| / max |ref| {lp_err:.1e}, worst parameter gradient {grad_err:.1e}")
            assert lp_err < LIMIT and grad_err < LIMIT, (rank, name, lp_err, grad_err)
