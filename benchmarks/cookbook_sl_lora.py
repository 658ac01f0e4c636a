"""The cookbook's supervised recipe with its default ``lora_rank=32`` against ``ringtune serve --cp 2``.

Run ``python benchmarks/cookbook_sl_lora.py [--model DIR|smollm2-135m] [--steps 8] [--lr 1e-3] [--moe [--ep 2]]
[--lora-rank N]``.

``--moe``: a tiny random Qwen3.5-MoE (GatedDeltaNet + attention hybrid, 8 experts top-2, shared expert) with
SmolLM2's tokenizer instead, with the recipe's default LoRA (adapters on the routed experts too, docs/lora.md);
``--ep 2`` serves it with ``--cp 2 --ep 2`` (experts split over the two CP ranks). ``--lora-rank 0``: full
fine-tuning instead of the recipe's default.

The unmodified ``tinker_cookbook.supervised.train.main`` (``train.Config`` with ``lora_rank`` left at its default
32) on the cookbook's ``example_data/conversations.jsonl`` (``role_colon`` renderer, batch 16, max length 256,
``save_every=4``) against a ``ringtune serve --cp 2`` child on 127.0.0.1; the model is a tiny random Llama with
SmolLM2's tokenizer (``tests/smollm_fixtures.tiny_smollm_dir``) unless ``--model`` names another. Printed: the
run's ``get_info`` (is_lora, rank), ``train_mean_nll`` per step, the first and last, and the checkpoints.
Run 1 crashes at batch ``steps - 2`` (its data loader raises, after the step-4 checkpoint); run 2, the same ``main``
on the same log path, resumes from that checkpoint (create-via-load of the LoRA run) and finishes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path

import tinker
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from ringtune.gateway.serve_process import ServeProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smollm_fixtures import tiny_smollm_dir, tiny_smollm_moe_dir  # test fixtures (tests/ is not a package)
from test_cookbook_sl import CrashingConversationBuilder, DataLoaderCrashError

API_KEY = "tml-cookbook-lora"
CONVERSATIONS = resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"


def config(
    url: str, model: str, log_path: Path, steps: int, lr: float, crash_at: int, lora_rank: int | None = None
) -> train.Config:
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name="role_colon", max_length=256, batch_size=16
    )
    builder = CrashingConversationBuilder(
        common_config=common, file_path=str(CONVERSATIONS), test_size=0, crash_at=crash_at
    )
    rank = {} if lora_rank is None else {"lora_rank": lora_rank}  # not given: the recipe's default (32)
    return train.Config(
        **rank,
        log_path=str(log_path),
        model_name=model,
        recipe_name="ringtune_cookbook_sl_lora",
        renderer_name="role_colon",
        dataset_builder=builder,
        learning_rate=lr,
        lr_schedule="constant",
        base_url=url,
        save_every=4,
        eval_every=0,
        infrequent_eval_every=0,
        max_steps=steps,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--moe", action="store_true", help="a tiny Qwen3.5-MoE")
    parser.add_argument("--ep", type=int, default=1, help="with --moe: expert parallelism")
    parser.add_argument("--lora-rank", type=int, default=None, help="default: the recipe's own (32); 0 = full")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.moe:
            model = str(tiny_smollm_moe_dir(root / "tiny-moe"))
        else:
            model = args.model or str(tiny_smollm_dir(root / "tiny-smollm"))
        extra = ["--cp", "2", "--context-length", "512"] + (["--ep", str(args.ep)] if args.ep > 1 else [])
        rank = args.lora_rank
        os.environ.update(HF_HUB_OFFLINE="1", TINKER_API_KEY=API_KEY)
        server = ServeProcess(
            model,
            checkpoint_root=root / "ckpt",
            log_path=root / "serve.log",
            api_key=API_KEY,
            extra_args=extra,
        )
        with server:
            log_path = root / "sl"
            crash_at = args.steps - 2  # after the checkpoint at step 4 (save_every=4), as a dying data loader would
            try:
                asyncio.run(train.main(config(server.url, model, log_path, args.steps, args.lr, crash_at, rank)))
            except DataLoaderCrashError as exc:
                print(f"run 1 crashed as planned: {exc}")
            asyncio.run(train.main(config(server.url, model, log_path, args.steps, args.lr, -1, rank)))  # resumes
            rows = [json.loads(x) for x in (log_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
            checkpoints = [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines()]
            run_id = checkpoints[-1]["state_path"].removeprefix("tinker://").split("/")[0]
            run = tinker.RestClient(base_url=server.url, api_key=API_KEY).get_training_run(run_id).result()
            print(f"run {run_id}: is_lora={run.is_lora} lora_rank={run.lora_rank}")
            for row in rows:
                print(f"step {row['step']}: train_mean_nll {row['train_mean_nll']:.4f}")
            print(f"checkpoints: {[(c['name'], c['state_path']) for c in checkpoints]}")
            print(f"train_mean_nll first {rows[0]['train_mean_nll']:.4f} -> last {rows[-1]['train_mean_nll']:.4f}")
            return 0 if rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"] else 1


if __name__ == "__main__":
    sys.exit(main())
