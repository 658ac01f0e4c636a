"""KL(sampler ‖ trainer) by context depth, per precision, through the SDK against real ``ringtune serve`` processes.

`python benchmarks/sampler_kl_depth.py [--model smollm2-135m] [--dtypes float32 bf16-mixed bf16-exact bfloat16]
[--depths 1024 4096 12288] [--samples 1] [--tokens 192] [--lora-rank 0] [--samplers builtin vllm]
[--vllm-python PY] [--out FILE.json]`

``--random-tokens``: prompts of seeded random token ids instead of text (for a tiny random model whose tokenizer
cannot read English, e.g. the vLLM tests' Llama: ``--model DIR --depths 64 192 384 --tokens 48``).

``--samplers builtin vllm`` measures each precision once per sampler: ringtune's own (``serve``'s default) and a
vLLM engine (``serve --sampler vllm``, started from ``--vllm-python``; docs/sampling.md). vLLM loads HF
directories only: the embedded SmolLM2-135M is written as one first (ringtune's export of the GGUF weights and
tokenizer), and both samplers serve that directory.

For each precision a server is started (``--dtype``), a full fine-tuning client made (``rank=0``), and its weights
handed to a sampling client (``save_weights_and_get_sampling_client``). ``--lora-rank R`` makes a LoRA client of
rank R instead (the cookbook's default is 32) and first takes one AdamW step (lr 1e-3, on the text's first 512
tokens), so that the adapters are not zero and the sampler's adapter path is measured.

For each depth D the prompt is the first D tokens of natural text (the demo's chat conversations rendered as
ChatML, then ringtune's parity passage, tokenized by the served tokenizer); the sampler draws ``--samples``
continuations of ``--tokens`` tokens at temperature 1; the trainer forwards each prompt + continuation
(``forward``, cross_entropy) and scores the same tokens. Per sampled token ``d = lp_sampler - lp_trainer``:

- ``kl_sample_train_v1 = mean(d)`` and ``kl_sample_train_v2 = mean(d²)/2``, exactly as
  ``tinker_cookbook.rl.metrics.compute_kl_sample_train`` computes them over action tokens;
- ``se_v1``: the standard error of v1 (std(d)/sqrt(n)): v1 is an unbiased but noisy estimate; a v1 below its
  ``se`` is indistinguishable from 0;
- ``max_abs = max |d|``.

Goal (issue 19): |v1| ≤ 2e-4 in bf16 mixed precision at every depth. The script prints a markdown table and
PASS/FAIL for the ``bf16-mixed`` and ``bf16-exact`` rows; ``--out`` also writes the JSON. Set ``PYTHONPATH`` to a
checkout to measure that checkout's code.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import tinker

from ringtune.gateway.serve_process import ServeProcess
from ringtune.parity.text import PASSAGE

API_KEY = "tml-kl-depth"
GOAL_V1 = 2e-4
CHAT = Path(__file__).resolve().parents[1] / "ringtune" / "demo" / "chat.jsonl"


def natural_text() -> str:
    """The demo conversations as ChatML, then the parity passage five times: about 13.2K SmolLM2 tokens of English
    (10.8K before the passage; past about 12K the text repeats, which the model may copy)."""
    parts = []
    for line in CHAT.read_text().splitlines():
        for m in json.loads(line)["messages"]:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(parts) + PASSAGE * 5


def hf_directory(model: str, dest: Path) -> Path:
    """``model`` (a ``.gguf`` file or the embedded SmolLM2-135M) written as an HF directory with its tokenizer,
    for an engine that loads only those (vLLM)."""
    from ringtune.models.checkpoints.hf import save_hf
    from ringtune.models.checkpoints.load import load_model
    from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir

    save_hf(load_model(model), dest)
    smollm2_tokenizer_dir(dest, None if model == "smollm2-135m" else model)
    return dest


def kl_stats(sampler_lp: np.ndarray, trainer_lp: np.ndarray) -> dict[str, float]:
    """The cookbook's v1/v2 of d = sampler - trainer (float64 arrays [n]), the standard error of v1, max |d|."""
    d = sampler_lp - trainer_lp
    return {
        "kl_sample_train_v1": float(d.mean()),
        "kl_sample_train_v2": float(0.5 * (d**2).mean()),
        "se_v1": float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan"),
        "max_abs": float(np.abs(d).max()),
        "tokens": int(d.size),
    }


def measure(
    url: str,
    model: str,
    depths: list[int],
    samples: int,
    tokens: int,
    seed: int,
    report=None,
    lora_rank: int = 0,
    random_tokens: bool = False,
) -> dict[int, dict[str, float]]:
    """Per depth (shallow first): sample, score the samples on the trainer, record the stats (``report(depth, stats)``
    after each, so a run cut short keeps its shallower depths). ``lora_rank`` > 0: a LoRA run, stepped once first."""
    result: dict[int, dict[str, float]] = {}
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(model, rank=lora_rank).result()
        tokenizer = tc.get_tokenizer()
        if random_tokens:
            ids = np.random.default_rng(seed).integers(0, len(tokenizer), max(depths) + 1).tolist()
        else:
            ids = tokenizer.encode(natural_text(), add_special_tokens=False)
        if len(ids) < max(depths):
            raise ValueError(f"depth {max(depths)} exceeds the {len(ids)} tokens of text")
        if lora_rank:  # fresh adapters add zero: one step makes them count
            step = tinker.Datum(
                model_input=tinker.ModelInput.from_ints(ids[:511]),
                loss_fn_inputs={"target_tokens": ids[1:512], "weights": [1.0] * 511},
            )
            tc.forward_backward([step], "cross_entropy").result()
            tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = tinker.SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, stop=[])
        for depth in sorted(depths):  # one depth at a time: a decode batch holds its rows' KV caches at full length
            future = sampler.sample(
                tinker.ModelInput.from_ints(ids[:depth]), num_samples=samples, sampling_params=params
            )
            datums, sampled = [], []
            for seq in future.result().sequences:
                full = ids[:depth] + list(seq.tokens)
                datums.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
                    )
                )
                sampled.append(np.asarray(seq.logprobs, dtype=np.float64))
            outs = tc.forward(datums, "cross_entropy").result().loss_fn_outputs
            trained = [o["logprobs"].to_torch().double().numpy()[depth - 1 :] for o in outs]
            result[depth] = kl_stats(np.concatenate(sampled), np.concatenate(trained))
            if report is not None:
                report(depth, result[depth])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bf16-mixed", "bf16-exact", "bfloat16"])
    parser.add_argument("--depths", nargs="+", type=int, default=[1024, 4096, 12288])
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning; R: a LoRA run of rank R")
    parser.add_argument("--label", default="", help="a name for this run in the table (e.g. before / after)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--random-tokens", action="store_true", help="seeded random prompts instead of text")
    parser.add_argument("--samplers", nargs="+", default=["builtin"], choices=["builtin", "vllm"])
    parser.add_argument("--vllm-python", default=None, help="the engine's interpreter (serve's --vllm-python)")
    parser.add_argument("--vllm-args", default="--enforce-eager", help="serve's --vllm-args (CPU: eager)")
    args = parser.parse_args()
    context = max(args.depths) + args.tokens + 64
    report: dict[str, dict] = {}

    def save() -> None:
        if args.out:
            args.out.write_text(
                json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "report": report}, indent=1)
            )

    with tempfile.TemporaryDirectory(prefix="kl-depth-") as tmp:
        model = args.model
        if "vllm" in args.samplers and not Path(model).is_dir():
            model = str(hf_directory(model, Path(tmp) / "model"))
        for dtype, sampler in [(d, s) for d in args.dtypes for s in args.samplers]:
            started = time.time()
            extra = ["--dtype", dtype, "--max-tokens-per-rank", str(context), "--model-name", args.model]
            if sampler == "vllm":
                extra += ["--sampler", "vllm", f"--vllm-args={args.vllm_args}"]
                extra += ["--vllm-python", args.vllm_python] if args.vllm_python else []
            name = dtype if args.samplers == ["builtin"] else f"{dtype} {sampler}"
            server = ServeProcess(
                model,
                checkpoint_root=Path(tmp) / name.replace(" ", "-"),
                log_path=Path(tmp) / f"serve-{name.replace(' ', '-')}.log",
                api_key=API_KEY,
                extra_args=extra,
            )
            report[name] = {}

            def record(depth: int, stats: dict, name: str = name, started: float = started) -> None:
                report[name][depth] = stats
                print(f"# {name} depth {depth}: {json.dumps(stats)} ({time.time() - started:.0f} s)", flush=True)
                save()

            with server:
                measure(
                    server.url,
                    args.model,
                    args.depths,
                    args.samples,
                    args.tokens,
                    args.seed,
                    record,
                    args.lora_rank,
                    args.random_tokens,
                )
            print(f"# {name}: {time.time() - started:.0f} s", flush=True)
    print(
        f"\n{args.label} model {args.model}, {args.samples} samples x {args.tokens} tokens per depth, "
        f"seed {args.seed}, " + (f"LoRA rank {args.lora_rank} after one step" if args.lora_rank else "full fine-tuning")
    )
    print("| precision | depth | kl_sample_train_v1 | ± se | kl_sample_train_v2 | max \\|d\\| |")
    print("|---|---:|---:|---:|---:|---:|")
    failed: dict[str, bool] = {}
    for dtype, rows in report.items():
        for depth, r in rows.items():
            print(
                f"| {dtype} | {depth} | {r['kl_sample_train_v1']:.2e} | {r['se_v1']:.1e} | "
                f"{r['kl_sample_train_v2']:.2e} | {r['max_abs']:.2e} |"
            )
            if dtype.startswith("bf16-"):
                failed[dtype] = failed.get(dtype, False) or abs(r["kl_sample_train_v1"]) > GOAL_V1
    for dtype, fail in failed.items():
        print(f"{dtype} |v1| <= {GOAL_V1:g} at every depth: {'FAIL' if fail else 'PASS'}")
    save()


if __name__ == "__main__":
    main()
