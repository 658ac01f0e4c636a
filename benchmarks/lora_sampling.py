"""Sampling from several LoRA runs on one base: one after another vs concurrently, with the rank's decode batch
shared across adapters (``--shared-decode``, the default) and without (``--no-shared-decode``).

Run ``python benchmarks/lora_sampling.py [--runs 8] [--samples 4] [--new-tokens 32] [--rank 32]
[--model smollm2-135m]``.

For each setting one server (``ringtune serve --model <model> --cp 2 [--no-shared-decode]``, a child on
127.0.0.1) gets ``--runs`` LoRA runs (rank R, every target group), each stepped once (``forward_backward`` of
8 datums of 64 tokens + ``optim_step``, so that the adapters differ from the base and from each other), then
each run's ``save_weights_and_get_sampling_client`` (an adapter snapshot on the shared base). Each sampling
call asks ``--samples`` sequences of ``--new-tokens`` tokens (``stop=[]``, a fixed seed per run) of a
16-token prompt.

1. **one after another**: run 1's call, then run 2's, ... (each waits for the previous answer);
2. **concurrently**: every run's call at once (one future each).

Printed per server: wall seconds of each phase, generated tokens per second, the ratio concurrent / one after
another. Shared, the concurrent calls' rows decode in one batch per rank (each row with its run's adapters);
unshared, each call's rows are a batch of their own and the calls take turns (``--sample-slice``). The
tokens of every run are compared between the two phases and the two servers: the same seeds give the same
tokens unless float32's batch-size variance flips a near-tie (the match fraction is printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import tinker
from lora_runs import datums  # the same 8 datums of 64 tokens

from ringtune.gateway.serve_process import ServeProcess

ADAM = tinker.AdamParams(learning_rate=1e-3)


def sample_all(samplers: list, prompt: tinker.ModelInput, args: argparse.Namespace, *, together: bool) -> list:
    """Every sampler's call (its seed = its index); at once when ``together``. Per run its sequences' tokens."""
    calls = []
    results = []
    for i, sampler in enumerate(samplers):
        params = tinker.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[], seed=i)
        call = sampler.sample(prompt, num_samples=args.samples, sampling_params=params)
        if together:
            calls.append(call)
        else:
            results.append(call.result())
    results.extend(call.result() for call in calls)
    return [[list(seq.tokens) for seq in result.sequences] for result in results]


def measure(args: argparse.Namespace, shared: bool) -> tuple[list, list]:
    """One server: both phases; prints the figures, returns each phase's tokens."""
    flag = "--shared-decode" if shared else "--no-shared-decode"
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--cp", "2", "--max-live-runs", str(args.runs + 1), flag]
        server = ServeProcess(
            args.model, checkpoint_root=Path(tmp) / "ckpt", log_path=Path(tmp) / "serve.log", extra_args=extra
        )
        with server, tinker.ServiceClient(base_url=server.url, api_key=server.api_key) as sc:
            print(
                f"server: ringtune serve --model {args.model} --cp 2 {flag}; {args.runs} LoRA runs of rank {args.rank}"
            )
            samplers = []
            for i in range(args.runs):
                tc = sc.create_lora_training_client(args.model, rank=args.rank, seed=i).result()
                vocab = tc.get_tokenizer().vocab_size
                tc.forward_backward(datums(vocab, i), "cross_entropy").result()
                tc.optim_step(ADAM).result()
                samplers.append(tc.save_weights_and_get_sampling_client().result())
            prompt = tinker.ModelInput.from_ints([(37 * k + 11) % vocab for k in range(16)])
            sample_all(samplers[:2], prompt, args, together=True)  # warm-up: first decode allocations
            start = time.monotonic()
            alone = sample_all(samplers, prompt, args, together=False)
            alone_s = time.monotonic() - start
            start = time.monotonic()
            together = sample_all(samplers, prompt, args, together=True)
            together_s = time.monotonic() - start
    tokens = args.runs * args.samples * args.new_tokens
    print(f"  one after another: {alone_s:.1f} s for {tokens} tokens ({tokens / alone_s:.1f} tokens/s)")
    print(f"  concurrently:      {together_s:.1f} s for {tokens} tokens ({tokens / together_s:.1f} tokens/s)")
    print(f"  throughput concurrent / one after another: {alone_s / together_s:.2f}x")
    print(f"  sequences equal in both phases: {match(alone, together):.3f}")
    return alone, together


def match(a: list, b: list) -> float:
    """Fraction of sequences whose tokens are equal."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    shared = measure(args, True)
    unshared = measure(args, False)
    print(f"sequences equal between the two servers (concurrent phase): {match(shared[1], unshared[1]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
