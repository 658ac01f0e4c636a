"""What ``bf16-exact`` costs and gives against ``bf16-mixed`` and ``float32``, measured in one run.

Run ``python benchmarks/exact_arithmetic.py [--steps 3] [--prompt 512] [--tokens 48]``. Each precision runs in a
fresh process on the embedded SmolLM2-135M, one after another on the same machine:

- training: ``--steps`` ``forward_backward`` + AdamW steps on the demo's chat data (rows of 2048 tokens), the
  median step seconds after a warm-up step, and the peak RSS (VmHWM, reset after the model is loaded);
- sampling: the trainer's sampler snapshot generates 2 × ``--tokens`` tokens after a ``--prompt``-token prompt
  (decode tokens per second), then the trainer forwards prompt + completion: max |sampled − trainer| log-prob
  over the sampled tokens (the KL(sampler ‖ trainer) the cookbook measures comes from these differences).

It prints a table and the ratios against ``bf16-mixed`` (docs/parity.md, "bf16-exact").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from attention_cp import _proc_status_kib, reset_peak_rss
from mixed_precision import ADAM, _datums
from sampler_kl_depth import natural_text

from ringtune.demo.data import load_conversations
from ringtune.demo.run import _batches
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT, load_model
from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir
from ringtune.models.precision import check_precision
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import snapshot_of
from ringtune.sample.sampler import generate
from ringtune.worker.executor import trainer_dtype_options

PRECISIONS = ("float32", "bf16-mixed", "bf16-exact")
TOKENIZER_DIR = Path("/tmp/ringtune-bench-tokenizer")


def _run(precision: str, steps: int, prompt_len: int, tokens: int, out: Any) -> None:
    torch.manual_seed(0)
    p = check_precision(precision)
    options = trainer_dtype_options(p)
    trainer = Trainer(load_model(EMBEDDED_DEFAULT, dtype=p.param_dtype), None, max_tokens_per_rank=2048, **options)
    data = _datums(load_conversations())
    batches = [[data[i] for i in idx] for idx in _batches(len(data), 8, steps + 1, seed=0)]
    reset_peak_rss()
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(ADAM)
        seconds.append(time.perf_counter() - start)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir(TOKENIZER_DIR)))
    prompt = tokenizer.encode(natural_text())[:prompt_len]
    sampler = snapshot_of(trainer.model)
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, stop=())
    start = time.perf_counter()
    with torch.inference_mode():
        sequences = generate(sampler, [prompt], params, num_samples=2)[0].sequences
    decode_s = time.perf_counter() - start
    worst = 0.0
    for seq in sequences:
        full = prompt + seq.tokens
        inputs = {"target_tokens": torch.tensor(full[1:]), "weights": torch.zeros(len(full) - 1)}
        lp = trainer.forward([TrainDatum(torch.tensor(full[:-1]), inputs)], "cross_entropy").outputs[0]["logprobs"]
        d = lp.double()[len(prompt) - 1 :] - torch.tensor(seq.logprobs, dtype=torch.float64)
        worst = max(worst, float(d.abs().max()))
    out.put(
        {
            "step_s": statistics.median(seconds[1:]),
            "peak_mib": _proc_status_kib("VmHWM") / 1024,
            "decode_tok_s": 2 * tokens / decode_s,
            "max_abs_d": worst,
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = {}
    for precision in PRECISIONS:
        out = ctx.Queue()
        proc = ctx.Process(target=_run, args=(precision, args.steps, args.prompt, args.tokens, out))
        proc.start()
        rows[precision] = out.get()
        proc.join()
        print(f"# {precision}: {rows[precision]}", flush=True)
    base = rows["bf16-mixed"]
    shape = f"{args.steps} steps of 8 conversations, {args.prompt}-token prompt, 2 x {args.tokens} tokens"
    print(f"\nSmolLM2-135M, {shape}")
    print("| precision | step s | peak RSS MiB | decode tok/s | max \\|sampled - trainer\\| | step / bf16-mixed |")
    print("|---|---:|---:|---:|---:|---:|")
    for precision, r in rows.items():
        print(
            f"| {precision} | {r['step_s']:.2f} | {r['peak_mib']:.0f} | {r['decode_tok_s']:.1f} | "
            f"{r['max_abs_d']:.1e} | {r['step_s'] / base['step_s']:.2f} |"
        )
    exact = rows["bf16-exact"]
    print(
        f"bf16-exact / bf16-mixed: step time {exact['step_s'] / base['step_s']:.2f}x, peak RSS "
        f"{exact['peak_mib'] / base['peak_mib']:.2f}x, decode speed {exact['decode_tok_s'] / base['decode_tok_s']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
