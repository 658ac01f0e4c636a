"""Mixed precision (``bf16-mixed``: float32 masters, bfloat16 decoder layers) against float32, in one run.

Run ``python benchmarks/mixed_precision.py [--steps 20] [--batch-size 2] [--probe-tokens 1024]``. Every figure is
measured in this run; see docs/memory.md "Mixed precision".

1. The layer probe's two layers (``ringtune.probes.layer_probe``: a GatedDeltaNet and a gated attention layer,
   Qwen3.5-4B shapes divided by ``--probe-scale``, on the probe's packed row): output, input gradient and
   parameter gradients of the bf16-mixed layer (bfloat16 compute on float32 weights, as a decoder layer runs it)
   and of the all-bfloat16 layer against float32: cosine and max / mean |Δ| relative to max |float32|.
2. Log-probs of the embedded SmolLM2-135M on the demo's held-out conversations (``ringtune.demo``): max / mean
   |Δ log-prob| of bf16-mixed and of bfloat16 against float32, in nats.
3. A ``--steps``-step fine-tune of SmolLM2-135M on the demo's chat data (same batches, AdamW lr 4e-5, clip 1.0)
   in float32, in bf16-mixed, and, as the noise yardstick, in float32 from the weights rounded to bfloat16 once:
   the three training-loss curves, the max relative difference of bf16-mixed and of the yardstick from float32,
   the held-out NLL after, seconds and the peak RSS (VmHWM, reset after the model is loaded) of each run, each in a
   fresh process. If bf16-mixed's difference is of the yardstick's size, it is what a bf16 rounding of the
   weights does to a 20-step trajectory: bf16 noise, not a bias.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import torch
from attention_cp import _proc_status_kib, reset_peak_rss

from ringtune.demo.data import load_conversations, render_chatml, split_held_out
from ringtune.demo.run import _batches
from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.layout.zigzag import zigzag_slice
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT, load_model
from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir
from ringtune.models.precision import check_precision, compute_params
from ringtune.models.shard import shard_of
from ringtune.probes.layer_probe import ProbeSizes, build_layers, cosine, probe_inputs, probe_row
from ringtune.worker.executor import trainer_dtype_options

BF16 = torch.bfloat16
ADAM = AdamParams(learning_rate=4e-5, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=1.0)  # the demo's
TOKENIZER_DIR = Path("/tmp/ringtune-bench-tokenizer")


# ---------------------------------------------------------------------------------------------- 1. probe


def _layer_run(layer: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, lens: tuple[int, ...], mode: str):
    """(output, dx, {param: grad}) in float32 of one layer in ``mode`` (float32 / bf16-mixed / bfloat16)."""
    layer.zero_grad(set_to_none=True)
    shard = shard_of(lens)  # CP = 1: the whole row, each sequence padded as the engine pads it
    x = zigzag_slice(x, shard.plan).requires_grad_(True)
    w = zigzag_slice(w, shard.plan)
    if mode == "bf16-mixed":
        with compute_params(layer, BF16):
            out = layer(x.to(BF16), shard)
    elif mode == "bfloat16":
        layer = copy.deepcopy(layer).to(BF16)
        out = layer(x.to(BF16), shard)
    else:
        out = layer(x, shard)
    (out.float() * w).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    return out.detach().float(), x.grad.float(), grads


def _delta(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """cosine, max |a - ref| / max |ref|, mean |a - ref| / mean |ref|."""
    d = (a.double() - ref.double()).abs()
    return cosine(a, ref), float(d.max() / ref.abs().max()), float(d.mean() / ref.abs().mean())


def probe_figures(tokens: int, scale: int, seed: int = 0) -> None:
    sizes = ProbeSizes(scale=scale)
    lens = probe_row(tokens, seed)
    layers = build_layers(sizes, dtype=torch.float32, seed=seed, sharpness=4.0)
    x, w = probe_inputs(tokens, sizes.scaled(sizes.hidden), dtype=torch.float32, seed=seed)
    print(f"1. layer probe (hidden {sizes.scaled(sizes.hidden)}, {tokens} tokens in {len(lens)} datums), vs float32")
    print("   layer      mode        tensor        cosine      max|Δ|/max|ref|  mean|Δ|/mean|ref|")
    for name, layer in layers.items():
        ref = _layer_run(layer, x, w, lens, "float32")
        for mode in ("bf16-mixed", "bfloat16"):
            got = _layer_run(layer, x, w, lens, mode)
            rows = [("output", got[0], ref[0]), ("input grad", got[1], ref[1])]
            worst = max(ref[2], key=lambda n: _delta(got[2][n], ref[2][n])[2])
            rows.append((f"worst param ({worst})", got[2][worst], ref[2][worst]))
            for label, a, b in rows:
                c, mx, mean = _delta(a, b)
                print(f"   {name:10} {mode:11} {label:13} {c:.6f}    {mx:.3e}        {mean:.3e}")


# ---------------------------------------------------------------------------------------------- data


def _datums(conversations: list) -> list[TrainDatum]:
    import transformers

    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        smollm2_tokenizer_dir(TOKENIZER_DIR)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    data = []
    for conv in conversations:
        ex = render_chatml(conv, tokenizer)
        inputs = {
            "target_tokens": torch.tensor(ex.tokens[1:], dtype=torch.int64),
            "weights": torch.tensor(ex.weights[1:], dtype=torch.float64),
        }
        data.append(TrainDatum(tokens=torch.tensor(ex.tokens[:-1], dtype=torch.int64), inputs=inputs))
    return data


def _nll(result, data: list[TrainDatum]) -> float:
    weight = sum(float(d.inputs["weights"].sum()) for d in data)
    return result.metrics["loss:sum"] / weight


def _trainer(precision: str, *, rounded: bool = False) -> Trainer:
    p = check_precision(precision)
    model = load_model(EMBEDDED_DEFAULT, dtype=p.param_dtype)
    if rounded:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(BF16))
    compute = trainer_dtype_options(p)
    return Trainer(model, None, max_tokens_per_rank=2048, **compute)


# ---------------------------------------------------------------------------------------------- 2. log-probs


def logprob_figures() -> None:
    _, held = split_held_out(load_conversations())
    data = _datums(held)
    lps = {}
    for precision in ("float32", "bf16-mixed", "bfloat16"):
        result = _trainer(precision).forward(data, "cross_entropy")
        lps[precision] = torch.cat([o["logprobs"] for o in result.outputs])
        print_nll = _nll(result, data)
        lps[precision + ":nll"] = torch.tensor(print_nll)
    n = lps["float32"].numel()
    print(f"2. SmolLM2-135M log-probs on the {len(data)} held-out conversations ({n} tokens), vs float32")
    for precision in ("bf16-mixed", "bfloat16"):
        d = (lps[precision] - lps["float32"]).abs()
        print(
            f"   {precision:11} max |Δlp| {float(d.max()):.4f}  mean |Δlp| {float(d.mean()):.5f} nats;"
            f" held-out NLL {float(lps[precision + ':nll']):.5f} (float32 {float(lps['float32:nll']):.5f})"
        )


# ---------------------------------------------------------------------------------------------- 3. fine-tune


def _finetune(kind: str, steps: int, batch_size: int, out: Any) -> None:
    """One run in this fresh process; puts {curve, held_out, seconds, peak_mib} on ``out``."""
    torch.set_num_threads(2)
    train_conv, held_conv = split_held_out(load_conversations())
    train, held = _datums(train_conv), _datums(held_conv)
    trainer = _trainer(
        "float32" if kind != "bf16-mixed" else "bf16-mixed", rounded=kind == "float32 (bf16-rounded init)"
    )
    base_rss = _proc_status_kib("VmRSS")
    reset_peak_rss()
    start = time.perf_counter()
    curve = []
    for indices in _batches(len(train), batch_size, steps, seed=0):
        batch = [train[i] for i in indices]
        curve.append(_nll(trainer.forward_backward(batch, "cross_entropy"), batch))
        trainer.optim_step(ADAM)
    seconds = time.perf_counter() - start
    peak = _proc_status_kib("VmHWM")
    held_out = _nll(trainer.forward(held, "cross_entropy"), held)
    out.put(
        {"curve": curve, "held_out": held_out, "seconds": seconds, "peak_mib": peak / 1024, "base_mib": base_rss / 1024}
    )


def finetune_figures(steps: int, batch_size: int) -> None:
    ctx = mp.get_context("spawn")
    runs = {}
    for kind in ("float32", "bf16-mixed", "float32 (bf16-rounded init)"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_finetune, args=(kind, steps, batch_size, queue))
        proc.start()
        runs[kind] = queue.get()
        proc.join()
    ref = runs["float32"]["curve"]
    print(f"3. SmolLM2-135M fine-tune, {steps} steps of {batch_size} conversations (train NLL per token)")
    print("   step  float32   bf16-mixed  fp32 rounded-init")
    for i in range(steps):
        r = [runs[k]["curve"][i] for k in runs]
        print(f"   {i + 1:4d}  {r[0]:.5f}   {r[1]:.5f}     {r[2]:.5f}")
    for kind, run in runs.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(run["curve"], ref, strict=True))
        print(
            f"   {kind:28} max rel diff vs float32 {rel:.2e}; held-out NLL after {run['held_out']:.5f}; "
            f"{run['seconds']:.1f} s; peak RSS {run['peak_mib']:.0f} MiB (after load {run['base_mib']:.0f} MiB)"
        )
    mixed = max(abs(a - b) / abs(b) for a, b in zip(runs["bf16-mixed"]["curve"], ref, strict=True))
    yard = max(abs(a - b) / abs(b) for a, b in zip(runs["float32 (bf16-rounded init)"]["curve"], ref, strict=True))
    print(f"   bf16-mixed / yardstick (max rel diff): {mixed / yard:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--probe-tokens", type=int, default=1024)
    parser.add_argument("--probe-scale", type=int, default=4)
    parser.add_argument("--skip", nargs="*", default=(), choices=("probe", "logprobs", "finetune"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    if "probe" not in args.skip:
        probe_figures(args.probe_tokens, args.probe_scale)
    if "logprobs" not in args.skip:
        logprob_figures()
    if "finetune" not in args.skip:
        finetune_figures(args.steps, args.batch_size)
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
