"""The cookbook's RL recipe with its default ``lora_rank=32`` against ``ringtune serve --cp 2``: it runs, resumes
after a crash, and its reward rises.

Run ``python benchmarks/cookbook_rl_lora.py [--steps 12] [--lr 1e-2] [--moe [--ep 2]]``.

The unmodified ``tinker_cookbook.rl.train.main`` (``train.Config`` with ``lora_rank`` left at its default 32,
``importance_sampling``) with the single-turn environment of ``tests/test_cookbook_rl.py`` rewarded here by the
fraction of the reply's characters that are upper-case letters (a random model's replies score about 0.08: room to
learn; the letters reward of the test starts near 0.9 on SmolLM2's vocabulary), batch 2 prompts x group 8, 16 tokens
per reply, ``num_epochs`` passes over the 6 prompts, a checkpoint every 4 steps, against a ``ringtune serve --cp 2``
child on 127.0.0.1. The model is a tiny random Llama with SmolLM2's tokenizer
(``tests/smollm_fixtures.tiny_smollm_dir``), or with ``--moe`` a tiny random Qwen3.5-MoE (LoRA on its routed
experts, shared expert, attention and unembedding). Run 1 crashes at step ``steps - 2`` (its dataset raises, after
the last checkpoint); run 2, the same ``main`` on the same log path, resumes from that checkpoint and finishes.
Printed: ``get_info`` of the run (is_lora, rank), per step the reward, the cookbook's on-policy figure
``optim/kl_sample_train_v1`` and the gradient norm; the exit status is 0 when the mean reward of the last 3 steps is
above that of the first 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import chz
import tinker
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from ringtune.gateway.serve_process import ServeProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smollm_fixtures import tiny_smollm_dir, tiny_smollm_moe_dir  # test fixtures (tests/ is not a package)
from test_cookbook_rl import PROMPTS, RENDERER, LettersDataset, LettersEnv, LettersGroupBuilder

API_KEY = "tml-cookbook-rl-lora"


class DatasetCrashError(RuntimeError):
    """Raised by :class:`CrashingLetters` to kill run 1 mid-training, as a failing data source would."""


def upper_fraction(text: str) -> float:
    """The reward: the fraction of the reply's characters that are upper-case letters (0 if empty)."""
    return sum(c.isupper() for c in text) / len(text) if text else 0.0


class UpperEnv(LettersEnv):
    """The test's one-turn environment, rewarded by :func:`upper_fraction`."""

    score = staticmethod(upper_fraction)
    metric = "upper_fraction"


@dataclass(frozen=True)
class UpperGroupBuilder(LettersGroupBuilder):
    async def make_envs(self) -> Sequence[Env]:
        return [UpperEnv(self.prompt, self.renderer) for _ in range(self.group_size)]


@dataclass(frozen=True)
class CrashingUpper(LettersDataset):
    """The test's prompts with :class:`UpperEnv`; its ``crash_at``-th ``get_batch`` call (0-based, in this
    process) raises."""

    crash_at: int = -1
    calls: list[int] = field(default_factory=lambda: [0])

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        self.calls[0] += 1
        if self.calls[0] - 1 == self.crash_at:
            raise DatasetCrashError(f"dataset crashed at its batch call {self.crash_at}, as planned")
        chosen = self.prompts[index * self.batch_size : (index + 1) * self.batch_size]
        return [UpperGroupBuilder(p, self.renderer, self.group_size) for p in chosen]


@chz.chz
class CrashingUpperBuilder(RLDatasetBuilder):
    model_name: str
    batch_size: int
    group_size: int
    crash_at: int

    async def __call__(self) -> tuple[RLDataset, RLDataset]:
        renderer = get_renderer(RENDERER, get_tokenizer(self.model_name))
        train_ds = CrashingUpper(PROMPTS, renderer, self.batch_size, self.group_size, crash_at=self.crash_at)
        test_ds = CrashingUpper(["Tell me a word.", "Say yes."], renderer, batch_size=2, group_size=2)
        return train_ds, test_ds


def config(url: str, model: str, log_path: Path, steps: int, lr: float, crash_at: int) -> train.Config:
    builder = CrashingUpperBuilder(model_name=model, batch_size=2, group_size=8, crash_at=crash_at)
    epochs = -(-steps // (len(PROMPTS) // 2))
    return train.Config(  # lora_rank not given: the recipe's default (32)
        log_path=str(log_path),
        model_name=model,
        recipe_name="ringtune_cookbook_rl_lora",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=lr,
        max_tokens=16,
        loss_fn="importance_sampling",
        base_url=url,
        eval_every=0,
        save_every=4,
        num_epochs=epochs,
        max_steps=steps,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--moe", action="store_true", help="a tiny Qwen3.5-MoE (LoRA on its experts)")
    parser.add_argument("--ep", type=int, default=1, help="with --moe: expert parallelism (--ep of serve)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(tiny_smollm_moe_dir(root / "tiny-moe") if args.moe else tiny_smollm_dir(root / "tiny"))
        os.environ.update(HF_HUB_OFFLINE="1", TINKER_API_KEY=API_KEY)
        extra = ["--cp", "2", "--ep", str(args.ep), "--context-length", "512"]
        server = ServeProcess(
            model, checkpoint_root=root / "ckpt", log_path=root / "serve.log", api_key=API_KEY, extra_args=extra
        )
        with server:
            log_path = root / "rl"
            try:
                asyncio.run(train.main(config(server.url, model, log_path, args.steps, args.lr, args.steps - 2)))
            except DatasetCrashError as exc:
                print(f"run 1 crashed as planned: {exc}")
            asyncio.run(train.main(config(server.url, model, log_path, args.steps, args.lr, -1)))  # resumes
            rows = [json.loads(x) for x in (log_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
            rows = [r for r in rows if "optim/kl_sample_train_v1" in r]
            checkpoints = [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines()]
            run_id = checkpoints[-1]["state_path"].removeprefix("tinker://").split("/")[0]
            run = tinker.RestClient(base_url=server.url, api_key=API_KEY).get_training_run(run_id).result()
    kind = "tiny Qwen3.5-MoE" if args.moe else "tiny Llama (SmolLM2 tokenizer)"
    print(
        f"\ncookbook rl.train, upper-case reward, default lora_rank, {kind}, serve --cp 2 --ep {args.ep}, lr {args.lr}"
    )
    print(f"run {run_id}: is_lora={run.is_lora} lora_rank={run.lora_rank}")
    for r in rows:
        print(
            f"  step {r['step']:2d}: reward {r['env/all/reward/total']:.3f}  "
            f"kl_sample_train_v1 {r['optim/kl_sample_train_v1']:+.2e}  grad_norm {r['grad_norm:mean']:.3f}"
        )
    print(f"checkpoints: {[c['name'] for c in checkpoints]}")
    first = sum(r["env/all/reward/total"] for r in rows[:3]) / 3
    last = sum(r["env/all/reward/total"] for r in rows[-3:]) / 3
    print(f"mean reward, first 3 steps {first:.3f} -> last 3 steps {last:.3f}")
    return 0 if last > first else 1


if __name__ == "__main__":
    raise SystemExit(main())
