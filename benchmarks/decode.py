"""Generation speed of ringtune's sampler against transformers' ``generate`` on the same SmolLM2-135M weights.

Run ``python benchmarks/decode.py [--batch 8] [--new-tokens 128] [--rounds 3] [--threads 1] [--quick]``.

Both sides get the same 8 prompts (16-64 tokens of English text, different lengths), greedy decoding of
exactly ``--new-tokens`` tokens (no EOS stop), float32 on CPU, ``torch.inference_mode``:

- ringtune: ``ringtune.sample.generate`` (prompts packed into one THD row through the training forward,
  then batched decode with KV caches);
- transformers 5.24: ``LlamaForCausalLM.generate(do_sample=False)`` on the left-padded batch with its
  attention mask (its default SDPA attention and dynamic cache).

Prefill time is a run with one new token (prefill + choosing one token); decode time is the full run minus
it. Rounds interleave the two sides (ours prefill, theirs prefill, ours full, theirs full) and the minimum of
each is taken (the machines are shared: the fastest round is the least disturbed one). Both clocks are
printed; at one thread (the default) the verdict uses process CPU time, the time on a dedicated core, since
wall time on a shared 2-core machine mostly measures the other processes.
Printed: prefill tokens/s (real prompt tokens, not pads), decode tokens/s (batch × (new − 1)
tokens), and the ratios ours / transformers with the goal >= 1.0 and PASS/FAIL; plus how many of the greedy
sequences are identical (information: left padding changes transformers' rounding slightly).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

PARAGRAPH = (
    "Paris is the capital and most populous city of France. It is located on the Seine river, in the north of the "
    "country. The city is known for its museums and architectural landmarks: the Louvre was the most visited art "
    "museum in the world, and the Eiffel Tower, built for the 1889 World's Fair, is its best-known symbol. Paris is "
    "also a major centre of finance, diplomacy, commerce, fashion and science."
)


class Clock:
    """Wall and process CPU seconds since construction."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict[str, float]:
        return {"wall": time.perf_counter() - self.wall, "cpu": time.process_time() - self.cpu}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def load_both():
    """(ours, transformers model, tokenizer) on the embedded SmolLM2-135M, float32, eval mode."""
    import transformers
    from transformers.initialization import no_init_weights

    from ringtune.models.checkpoints.gguf import load_gguf_llama, smollm2_gguf_path
    from ringtune.models.checkpoints.load import load_model
    from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir

    path = smollm2_gguf_path()
    config, state = load_gguf_llama(path)
    with no_init_weights():
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(tempfile.mkdtemp(), path))
    return load_model("smollm2-135m").eval(), hf.eval(), tokenizer


def make_prompts(tokenizer, batch: int) -> list[list[int]]:
    ids = tokenizer.encode(PARAGRAPH)
    lens = [16 + (48 * i) // max(1, batch - 1) for i in range(batch)]  # 16 .. 64 tokens
    return [ids[i : i + n] for i, n in enumerate(lens)]


def run_ours(model, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    from ringtune.sample import SamplingParams, generate

    clock = Clock()
    out = generate(model, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, stop=[]))
    return clock.read(), [r.sequences[0].tokens for r in out]


def run_hf(model, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = Clock()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return clock.read(), out[:, width:].tolist()


def rates(times: dict[str, list[dict[str, float]]], clock: str, prompt_tokens: int, decoded: int):
    """Per side: (prefill tok/s, decode tok/s, fastest prefill s, fastest full s) on ``clock`` ("wall" or "cpu")."""
    out = {}
    for side in ("ours", "hf"):
        prefill = min(t[clock] for t in times[f"{side}_prefill"])
        full = min(t[clock] for t in times[f"{side}_full"])
        out[side] = (prompt_tokens / prefill, decoded / (full - prefill), prefill, full)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: CPU time = work)")
    parser.add_argument("--quick", action="store_true", help="1 round of 32 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 32
    torch.set_num_threads(args.threads)
    ours, hf, tokenizer = load_both()
    prompts = make_prompts(tokenizer, args.batch)
    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"SmolLM2-135M float32, batch {args.batch}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens ({prompt_tokens} in all), {args.new_tokens} new tokens, greedy, {torch.get_num_threads()} threads"
    )
    run_ours(ours, prompts, 2)  # warm-up both (thread pools, allocator)
    run_hf(hf, prompts, 2)
    times: dict[str, list[dict[str, float]]] = {"ours_prefill": [], "hf_prefill": [], "ours_full": [], "hf_full": []}
    tokens_ours = tokens_hf = None
    for _ in range(args.rounds):
        times["ours_prefill"].append(run_ours(ours, prompts, 1)[0])
        times["hf_prefill"].append(run_hf(hf, prompts, 1)[0])
        t, tokens_ours = run_ours(ours, prompts, args.new_tokens)
        times["ours_full"].append(t)
        t, tokens_hf = run_hf(hf, prompts, args.new_tokens)
        times["hf_full"].append(t)
    decoded = args.batch * (args.new_tokens - 1)
    # With one thread, process CPU time is the time on a dedicated core; wall time on a shared machine also
    # counts the other processes' turns. The verdict uses CPU time at 1 thread, wall time otherwise.
    main_clock = "cpu" if args.threads == 1 else "wall"
    ratios = {}
    for clock in ("cpu", "wall") if args.threads == 1 else ("wall",):
        r = rates(times, clock, prompt_tokens, decoded)
        print(f"  {clock} time, fastest of {args.rounds} rounds:")
        for side, name in (("ours", "ringtune"), ("hf", "transformers")):
            prefill, decode, t_prefill, t_full = r[side]
            print(
                f"    {name:>12}: prefill {prefill:7.0f} tok/s ({t_prefill * 1e3:7.1f} ms), "
                f"decode {decode:6.1f} tok/s (full run {t_full:6.2f} s)"
            )
        ratios[clock] = (r["ours"][0] / r["hf"][0], r["ours"][1] / r["hf"][1])
        print(f"    ratios ringtune / transformers: prefill {ratios[clock][0]:.2f}x, decode {ratios[clock][1]:.2f}x")
    prefill_ratio, decode_ratio = ratios[main_clock]
    print(f"[1] decode tokens/s ringtune / transformers ({main_clock}) = {decode_ratio:.2f}x (goal >= 1.0) "
          f"{verdict(decode_ratio >= 1)}")  # fmt: skip
    print(f"[2] prefill tokens/s ringtune / transformers ({main_clock}) = {prefill_ratio:.2f}x (goal >= 1.0) "
          f"{verdict(prefill_ratio >= 1)}")  # fmt: skip
    same = sum(a == b for a, b in zip(tokens_ours or [], tokens_hf or [], strict=True))
    print(f"[3] identical greedy sequences: {same}/{args.batch} (information)")
    return 0 if decode_ratio >= 1 and prefill_ratio >= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
