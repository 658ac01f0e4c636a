"""The cookbook's RL trainer on a MoE model at ``--cp 2 --ep 2``, with and without routing replay (R3).

Run ``python benchmarks/cookbook_rl_moe.py [--steps 3] [--dtype bfloat16]``.

The unmodified ``tinker_cookbook.rl.train.main`` (``importance_sampling``, ``lora_rank=0``, full fine-tuning: the
recipes' LoRA default under EP is ``cookbook_rl_lora.py --moe --ep 2``) with the single-turn "letters" environment
of ``tests/test_cookbook_rl.py`` (reward = the fraction of ASCII letters in the reply; batch 2 prompts x group 4)
against a tiny random Qwen3.5-MoE with SmolLM2's tokenizer (``tests/smollm_fixtures.tiny_smollm_moe_dir``), served
twice on 127.0.0.1: ``ringtune serve --cp 2 --ep 2 --dtype <dtype>`` without and with ``--routing-replay``. Printed
per arm and step: the cookbook's own on-policy figures ``optim/kl_sample_train_v1`` / ``_v2`` (sampler log-probs
against the trainer's on the sampled tokens) and the reward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from tinker_cookbook.rl import train

from ringtune.gateway.serve_process import ServeProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smollm_fixtures import tiny_smollm_moe_dir  # test fixtures (tests/ is not a package)
from test_cookbook_rl import RENDERER, LettersDatasetBuilder

API_KEY = "tml-cookbook-rl-moe"


def run_arm(model: str, root: Path, steps: int, dtype: str, replay: bool) -> list[dict]:
    extra = ["--cp", "2", "--ep", "2", "--dtype", dtype, "--context-length", "512", "--log-level", "info"]
    extra += ["--routing-replay"] if replay else []
    name = "replay" if replay else "plain"
    server = ServeProcess(
        model, checkpoint_root=root / f"ckpt-{name}", log_path=root / f"{name}.log", api_key=API_KEY, extra_args=extra
    )
    with server:
        builder = LettersDatasetBuilder(model_name=model, renderer_name=RENDERER, batch_size=2, group_size=4)
        config = train.Config(
            log_path=str(root / f"rl-{name}"),
            model_name=model,
            recipe_name="ringtune_cookbook_rl_moe",
            renderer_name=RENDERER,
            dataset_builder=builder,
            learning_rate=1e-3,
            max_tokens=16,
            loss_fn="importance_sampling",
            lora_rank=0,
            base_url=server.url,
            eval_every=0,
            save_every=0,
            max_steps=steps,
        )
        asyncio.run(train.main(config))
    rows = [json.loads(x) for x in (root / f"rl-{name}" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "optim/kl_sample_train_v1" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "bf16-mixed", "float32"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(tiny_smollm_moe_dir(root / "tiny-moe"))
        os.environ.update(HF_HUB_OFFLINE="1", TINKER_API_KEY=API_KEY)
        arms = {"no replay": run_arm(model, root, args.steps, args.dtype, False)}
        arms["replay"] = run_arm(model, root, args.steps, args.dtype, True)
    print(f"\ncookbook rl.train (importance_sampling, letters env) on a tiny Qwen3.5-MoE, --cp 2 --ep 2, {args.dtype}")
    for arm, rows in arms.items():
        for r in rows:
            print(
                f"  {arm:9s} step {r['step']}: kl_sample_train_v1 {r['optim/kl_sample_train_v1']:+.3e}  "
                f"v2 {r['optim/kl_sample_train_v2']:.3e}  reward {r['env/all/reward/total']:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
