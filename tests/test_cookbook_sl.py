"""The unmodified cookbook supervised trainer (``tinker_cookbook.supervised.train.main``) against a live
``ringtune serve`` child (a tiny random Llama with SmolLM2's tokenizer), offline.

Run 1 trains on the cookbook's own ``example_data/conversations.jsonl`` (``FromConversationFileBuilder``,
``renderer_name="role_colon"``, ``lora_rank=0`` = full fine-tuning, ``save_every=2``) and crashes at batch 4
(the training dataset raises, as a dying data loader would), after the cookbook saved its step-2 checkpoint.
Run 2 is the same ``main`` on the same ``log_path``: it reads ``checkpoints.jsonl``, restores weights and AdamW
through create-via-load (``create_training_client_from_state_with_optimizer``), drops the metrics rows it will
redo, and continues at step 2 to the end. The evaluators stay off (``test_size=0``, ``eval_every=0``): the
``SamplerNLLEvaluator`` needs the sampler, which the gateway does not serve yet.
"""

from __future__ import annotations

import asyncio
import json
import math
from importlib import resources
from pathlib import Path

import chz
import pytest
import tinker
from smollm_fixtures import cookbook_server
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig, SupervisedDataset

API_KEY = "tml-cookbook"
RENDERER = "role_colon"  # generic "User: ... Assistant: ..." format; the cookbook's model registry knows no tiny model
BATCH = 16  # 128 conversations -> 8 batches per epoch
MAX_STEPS = 6
CRASH_AT = 4
CONVERSATIONS = resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"


class DataLoaderCrashError(RuntimeError):
    """Raised by :class:`CrashingDataset` to end run 1 the way a real crash would (no final checkpoint)."""


class CrashingDataset(SupervisedDataset):
    """The cookbook's dataset, except that ``get_batch(crash_at)`` raises :class:`DataLoaderCrashError`."""

    def __init__(self, inner: SupervisedDataset, crash_at: int) -> None:
        self.inner, self.crash_at = inner, crash_at

    def get_batch(self, index: int) -> list[tinker.Datum]:
        if index == self.crash_at:
            raise DataLoaderCrashError(f"simulated crash at batch {index}")
        return self.inner.get_batch(index)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, seed: int = 0) -> None:
        self.inner.set_epoch(seed)


@chz.chz
class CrashingConversationBuilder(FromConversationFileBuilder):
    """``FromConversationFileBuilder`` whose training split crashes at batch ``crash_at`` (-1: never)."""

    crash_at: int = -1

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        train_ds, test_ds = super().__call__()
        return (CrashingDataset(train_ds, self.crash_at) if self.crash_at >= 0 else train_ds), test_ds


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with cookbook_server(tmp_path_factory.mktemp("cookbook-sl"), api_key=API_KEY, context_length=512) as served:
        yield served


def sl_config(server, log_path: Path, crash_at: int) -> train.Config:
    model = str(server["model_dir"])  # a local dir: the cookbook's get_tokenizer loads it offline
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=256, batch_size=BATCH
    )
    builder = CrashingConversationBuilder(
        common_config=common, file_path=str(CONVERSATIONS), test_size=0, crash_at=crash_at
    )
    return train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="ringtune_cookbook_sl_test",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=1e-3,
        lr_schedule="constant",
        lora_rank=0,
        base_url=server["url"],
        save_every=2,
        eval_every=0,
        infrequent_eval_every=0,
        max_steps=MAX_STEPS,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_id_of(tinker_path: str) -> str:
    return tinker_path.removeprefix("tinker://").split("/")[0]


def test_supervised_train_crash_and_resume(server, tmp_path):
    log_path = tmp_path / "sl-run"
    with pytest.raises(DataLoaderCrashError):
        asyncio.run(train.main(sl_config(server, log_path, crash_at=CRASH_AT)))
    first = read_jsonl(log_path / "checkpoints.jsonl")
    assert [(c["name"], c["batch"]) for c in first] == [("000002", 2)], first
    run1 = run_id_of(first[0]["state_path"])
    assert first[0]["state_path"] == f"tinker://{run1}/weights/000002"
    assert first[0]["sampler_path"] == f"tinker://{run1}/sampler_weights/000002"
    steps_before = [row["step"] for row in read_jsonl(log_path / "metrics.jsonl")]
    assert steps_before == [0, 1, 2], steps_before  # step 3 was in flight when batch 4 crashed

    asyncio.run(train.main(sl_config(server, log_path, crash_at=-1)))  # same log_path: resumes

    records = read_jsonl(log_path / "checkpoints.jsonl")
    run2 = run_id_of(records[-1]["state_path"])
    assert run2 != run1  # create-via-load made a new training run
    # run 2 starts at step 2 and saves at steps 2 and 4 (save_every=2), then its final checkpoint
    assert [(c["name"], run_id_of(c["state_path"])) for c in records] == [
        ("000002", run1),
        ("000002", run2),
        ("000004", run2),
        ("final", run2),
    ], records
    assert (records[-1]["epoch"], records[-1]["batch"]) == (1, 0)  # the loop state "training complete"

    rows = read_jsonl(log_path / "metrics.jsonl")
    # the resumed run dropped its redo rows (step >= 2) and continued: every step once, in order
    assert [row["step"] for row in rows] == list(range(MAX_STEPS)), [row["step"] for row in rows]
    for row in rows:
        assert math.isfinite(row["train_mean_nll"]) and row["train_mean_nll"] > 0, row
        assert row["num_sequences"] == BATCH and row["learning_rate"] == pytest.approx(1e-3)
    # a random 49,152-token model starts near ln(49152) = 10.8 per token; six AdamW steps at 1e-3 lower it
    # (measured: 10.81 -> 10.51; deterministic data order and weights)
    assert 9.0 < rows[0]["train_mean_nll"] < 12.0
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"] - 0.2, [r["train_mean_nll"] for r in rows]

    rest = tinker.RestClient(base_url=server["url"], api_key=API_KEY)
    listed1 = {c.checkpoint_id for c in rest.list_checkpoints(run1).result().checkpoints}
    listed2 = {c.checkpoint_id for c in rest.list_checkpoints(run2).result().checkpoints}
    assert listed1 == {"weights/000002", "sampler_weights/000002"}
    assert listed2 == {
        "weights/000002",
        "sampler_weights/000002",
        "weights/000004",
        "sampler_weights/000004",
        "weights/final",
        "sampler_weights/final",
    }
    resumed = rest.get_training_run(run2).result()
    assert resumed.user_metadata == {"renderer_name": RENDERER}
    assert resumed.is_lora is False and resumed.base_model == str(server["model_dir"])
    # the final sampler checkpoint is a loadable HF directory with the trained weights
    final_dir = server["root"] / "checkpoints" / run2 / "sampler_weights" / "final"
    assert (final_dir / "config.json").is_file()

    assert server["proc"].proc.poll() is None, server["proc"].log_tail()
