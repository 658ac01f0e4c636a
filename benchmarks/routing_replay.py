"""What routing replay (R3) buys: KL(sampler ‖ trainer) in bfloat16 with and without replay, on the same rollouts.

Run ``python benchmarks/routing_replay.py [--prompts 16] [--tokens 48] [--samples 2] [--dtype bfloat16]``.

A random Qwen3.5-MoE (``support.tiny_models``, widened by ``--hidden`` and ``--experts``; routers drawn
at std 0.5 so that routing differs per token) is loaded in ``--dtype``. The real sampler
(:func:`ringtune.sample.generate`, ``record_routing=True``) draws ``--samples`` sequences of ``--tokens`` tokens
at temperature 1 for ``--prompts`` random prompts, recording the experts each MoE layer chose for every token
it fed. The real trainer (:class:`ringtune.engine.trainer.Trainer`, one process) then forwards every sequence
(prompt + tokens[:-1]) twice: with the router choosing (no replay) and with the recorded routing (replay).
Per sampled token ``d = lp_trainer - lp_sampler``; printed per arm: ``k1 = mean(-d)``, ``k3 = mean(e^d - 1 - d)``
(:func:`ringtune.parity.sampler_kl.kl_estimates`) and max |d|; and the routing mismatch: the fraction of
(token, MoE layer) whose top-k expert set in the trainer's own forward differs from the sampler's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from ringtune.engine.batch import TrainDatum
from ringtune.engine.trainer import Trainer
from ringtune.layout import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.layers.moe import capturing_routing
from ringtune.models.shard import shard_of
from ringtune.parity.sampler_kl import kl_estimates
from ringtune.sample import SamplingParams, generate

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.tiny_models import hf_config


def random_moe(path: Path, hidden: int, experts: int, seed: int) -> None:
    import transformers

    torch.manual_seed(seed)
    config = hf_config("qwen3_5_moe")
    config.hidden_size, config.num_experts, config.vocab_size = hidden, experts, 512
    config.num_attention_heads, config.head_dim = 4, hidden // 4
    config._attn_implementation = "eager"
    model = transformers.Qwen3_5MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # routing that differs per token (as tiny_models.hf_model does)
    model.save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        random_moe(Path(tmp), args.hidden, args.experts, args.seed)
        sampler_model = load_hf(tmp, dtype=dtype).eval()
        gen = torch.Generator().manual_seed(args.seed)
        vocab = sampler_model.config.vocab_size
        prompts = [
            torch.randint(0, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 40, (args.prompts,), generator=gen)
        ]
        params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=args.seed, stop=[])
        results = generate(sampler_model, prompts, params, num_samples=args.samples, record_routing=True)
        sequences = [(p, s) for p, r in zip(prompts, results, strict=True) for s in r.sequences]
        trainer = Trainer(load_hf(tmp, dtype=dtype), None, max_tokens_per_rank=4096)

        def datum(prompt: list[int], seq, routing) -> TrainDatum:
            full = prompt + seq.tokens
            weights = torch.zeros(len(full) - 1, dtype=torch.float64)
            return TrainDatum(
                tokens=torch.tensor(full[:-1]),
                inputs={"target_tokens": torch.tensor(full[1:]), "weights": weights},
                routing=routing,
            )

        sampled = np.concatenate([np.asarray(s.logprobs, dtype=np.float64) for _, s in sequences])
        figures = {}
        for arm, use in (("no replay", False), ("replay", True)):
            data = [datum(p, s, s.routing if use else None) for p, s in sequences]
            out = trainer.forward_backward(data, "cross_entropy", forward_only=True).outputs
            lps = [o["logprobs"].double().numpy()[len(p) - 1 :] for o, (p, _) in zip(out, sequences, strict=True)]
            figures[arm] = kl_estimates(sampled, np.concatenate(lps))
        mismatched = total = 0
        for prompt, seq in sequences:  # the trainer's own routing (packed forward) against the sampler's
            fed = prompt + seq.tokens[:-1]
            shard = shard_of([len(fed)])
            with torch.no_grad(), capturing_routing(trainer.model) as captured:
                trainer.model.hidden_states(zigzag_slice(torch.tensor(fed), shard.plan), shard)
            own = torch.stack([c[0] for c in captured], dim=1)[: len(fed)].sort(-1).values
            mismatched += int((own != seq.routing.long().sort(-1).values).any(-1).sum())
            total += own.shape[0] * own.shape[1]
    print(
        f"random Qwen3.5-MoE (hidden {args.hidden}, {args.experts} experts, top-2, 4 layers), {args.dtype}; "
        f"{len(sequences)} sequences of {args.tokens} sampled tokens at temperature 1"
    )
    for arm, f in figures.items():
        print(f"  {arm:9s}: KL k1 {f['k1']:.3e}  k3 {f['k3']:.3e}  max |d| {f['max_abs']:.3e}")
    print(
        f"  routing mismatch (trainer's own top-k set != sampler's): {mismatched / total:.4f} of {total} (token, layer)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
