"""The LoRA parity figures behind tests/test_lora.py, printed: float32 vs Hugging Face ``peft`` at CP 1/2/4 and the
float64 layout invariance of adapter gradients.

Run ``python benchmarks/lora_parity.py`` (4 gloo ranks, about a minute). Per family (Llama untied, Qwen3 tied)
and CP: max |Δ log-prob| and max relative adapter-gradient difference against ``peft`` on the same adapters
(``tests/test_lora.py::peft_case``); per loss and (DP, CP) layout of a Qwen3.5 LoRA trainer: max |Δ| of
outputs, summed adapter gradients and post-AdamW adapters against DP=CP=1 (``invariance_case``).
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_lora  # the cases the tests assert on (tests/ is not a package)
from support.harness import RankPool
from support.tiny_models import hf_model


def main() -> int:
    root = pathlib.Path(tempfile.mkdtemp())
    for family, seed in (("llama", 7), ("qwen3", 7), ("qwen3_5", 21)):
        hf_model(family, seed=seed).save_pretrained(root / family)
    pool = RankPool(4, timeout=600)
    try:
        for family in ("llama", "qwen3"):
            res = pool.run(test_lora.peft_case, root=str(root), family=family)
            for cp in (1, 2, 4):
                lp = max(r[cp][0] for r in res)
                grad = max(r[cp][1] for r in res)
                print(f"float32 vs peft, {family} CP{cp}: max |Δ log-prob| {lp:.2e}, max relative grad diff {grad:.2e}")
        for loss in ("cross_entropy", "ppo"):
            runs = {
                k: v for r in pool.run(test_lora.invariance_case, root=str(root), loss_fn=loss) for k, v in r.items()
            }
            _, ref_out, ref_grads, ref_weights = runs[1, 1]
            for key, (_, outs, grads, weights) in runs.items():
                out = max(test_lora._max(a, b) for a, b in zip(outs, ref_out, strict=True))
                grad, after = test_lora._max(grads, ref_grads), test_lora._max(weights, ref_weights)
                print(f"float64 {loss} {key}: outputs {out:.1e}, adapter grads {grad:.1e}, stepped {after:.1e}")
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
