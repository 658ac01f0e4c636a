"""Sampling throughput through the gateway with 1 vs 2 worker ranks, measured in one run.

Starts ``ringtune serve`` twice on one model (DP=1, then DP=2; each rank gets ``cpu_count / ranks`` threads),
sends ``--requests`` concurrent ``sample`` calls through the real SDK (``--new-tokens`` tokens each, ``stop=[]``
so every sequence has the same length) and prints generated tokens per second and the ratio DP=2 / DP=1.
Concurrent requests are batched per sampling session and spread round-robin over the ranks.

    .venv/bin/python benchmarks/sampling_throughput.py [--model DIR] [--requests 32] [--new-tokens 64]

Without ``--model`` a random Llama (hidden 256, 4 layers, vocab 4096) is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import tinker

from ringtune.gateway.serve_process import ServeProcess

API_KEY = "tml-bench"


def random_model(dest: Path) -> Path:
    """A random transformers Llama saved to ``dest`` (no tokenizer: the benchmark sends token ids)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(dest)
    return dest


def measure(model: Path, dp: int, requests: int, new_tokens: int, log_dir: Path) -> float:
    """Generated tokens per second of ``requests`` concurrent samples on a DP=``dp`` server."""
    server = ServeProcess(
        str(model),
        checkpoint_root=log_dir / f"ckpt-{dp}",
        log_path=log_dir / f"serve-{dp}.log",
        api_key=API_KEY,
        extra_args=["--dp", str(dp)],
    )
    with server, tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as sc:
        sampler = sc.create_sampling_client(base_model=str(model)).result()
        params = tinker.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=0)
        prompts = [tinker.ModelInput.from_ints([1 + i, 2 + i, 3 + i, 4 + i]) for i in range(requests)]
        sampler.sample(prompts[0], 1, params).result()  # warm-up
        start = time.perf_counter()
        futures = [sampler.sample(p, 1, params) for p in prompts]
        tokens = sum(len(f.result(timeout=600).sequences[0].tokens) for f in futures)
        return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an HF checkpoint directory (default: a random Llama)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else random_model(Path(tmp) / "model")
        one = measure(model, 1, args.requests, args.new_tokens, Path(tmp))
        two = measure(model, 2, args.requests, args.new_tokens, Path(tmp))
    print(f"sampling throughput, {args.requests} concurrent requests x {args.new_tokens} new tokens:")
    print(f"  1 rank : {one:8.1f} tokens/s")
    print(f"  2 ranks: {two:8.1f} tokens/s  ({two / one:.2f}x; {os.cpu_count()} CPU cores shared by the ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
