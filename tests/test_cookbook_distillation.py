"""The cookbook's on-policy distillation (``tinker_cookbook.distillation.train_on_policy.main``), unmodified, with
teacher and student both served by one ``ringtune serve`` (``--model`` given twice), offline.

A pair with a learnable gap, both tiny Llamas with SmolLM2's real tokenizer (so the cookbook's ``role_colon``
renderer works) from one seed: the student is :func:`tiny_smollm_class_dir` (every token without ASCII letters,
1,979 of 49,152, shares one direction through the final norm's weights of hidden dims 0 and 1, which cancel), the
teacher the same weights with that direction switched on (:func:`tiny_smollm_class_teacher_dir`: norm weight of
dim 0 +0.05, dim 1 -0.05, about +4.8 nats for the whole class; after a no-letter continuation of a prompt the
seed-1 teacher puts 97-100 % of its mass on the class, the student 20-95 %). The recipe samples from the student
(a LoRA run of its default rank 32; LoRA does not reach the norm weights, but it adapts ``lm_head``, and the
teacher is a rank-2 change of the student's unembedding, its columns 0 and 1 scaled, so the adapter can reach it
exactly), asks the teacher's sampling client (``create_sampling_client(base_model=<teacher>)``) for
``compute_logprobs`` of every sampled sequence, and trains the student on the reverse-KL advantages with
``importance_sampling``. Local prompts stand in for the recipe's DeepMath / Tulu-3 downloads.

What is asserted: the recipe runs unmodified against one server holding both models, ``teacher_kl`` is reported
every step, starts far from zero (another model) and falls: the last step's is below 0.7 x the first's. Measured
(lr 1e-2, 3 steps, 2 groups of 4, 12 tokens), teacher_kl at steps 0, 1, 2: seed 1 (the test's) 1.22, 0.006,
0.017 / 1.40, 0.015, 0.003 / 1.33, 0.028, 0.010 / 1.11, 0.018, 0.021 / 1.44, 0.022, 0.014 / 1.54, 0.022,
0.008 (the student moves its mass onto the class, uniform within it: its sampled entropy 7.58 = ln 1,979, and the
KL of that to the teacher is 0.007-0.04 per position); seed 2 1.36, 0.36, 0.36 / 1.15, 0.35, 0.38;
seed 0 1.11, 0.56, 0.56 / 1.00, 0.49, 0.58 / 1.09, 0.59, 0.57 / 1.11, 0.62, 0.51
(its student learns the class only in part). lr 3e-2 overshoots (seed 0: 1.12, 0.54, 0.32, 1.30); full
fine-tuning (``lora_rank=0``) falls alike (seed 0: 1.15, 0.57, 0.54, 0.58). The previous pair (one random model,
the teacher's unembedding flatter) stayed flat (0.94, 0.86, 0.89): nothing there was learnable in a few steps.
"""

from __future__ import annotations

import asyncio
import json

import chz
import pytest
import tinker
import torch
from smollm_fixtures import tiny_smollm_class_dir, tiny_smollm_class_teacher_dir
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from ringtune.gateway.serve_process import ServeProcess

API_KEY = "tml-cookbook-distill"
RENDERER = "role_colon"
PROMPTS = ["Name a fruit.", "Say hello.", "Count to three.", "Pick a colour.", "Spell cat.", "Greet me."] * 2
STEPS = 3
SEED = 1  # seed 0 falls less (to 0.46-0.58 x), seed 2 to 0.27-0.33 x; module docstring
LEARNING_RATE = 1e-2  # 3e-2 overshoots (module docstring)


@chz.chz
class LocalPromptsBuilder(RLDatasetBuilder):
    """The recipe's :class:`PromptOnlyDataset` over :data:`PROMPTS` (no download)."""

    model_name: str
    batch_size: int
    group_size: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = get_tokenizer(self.model_name)
        renderer = get_renderer(RENDERER, tokenizer)
        return PromptOnlyDataset(PROMPTS, self.batch_size, self.group_size, renderer, tokenizer), None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook-distill")
    student = tiny_smollm_class_dir(root / "models" / "student", seed=SEED)
    teacher = tiny_smollm_class_teacher_dir(root / "models" / "teacher", seed=SEED)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("TINKER_API_KEY", API_KEY)
        proc = ServeProcess(
            str(student),
            checkpoint_root=root / "checkpoints",
            log_path=root / "server.log",
            api_key=API_KEY,
            extra_args=["--model", str(teacher), "--context-length", "512"],
        )
        with proc:
            yield {"url": proc.url, "student": str(student), "teacher": str(teacher), "proc": proc}


def test_capabilities_list_both_models(server):
    caps = tinker.RestClient(base_url=server["url"], api_key=API_KEY).get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert names == [server["student"], server["teacher"]]


def test_on_policy_distillation_teacher_kl_falls(server, tmp_path):
    log_path = tmp_path / "distill"
    dataset = LocalPromptsBuilder(model_name=server["student"], batch_size=2, group_size=4)
    config = train_on_policy.Config(
        learning_rate=LEARNING_RATE,
        dataset_configs=[
            DistillationDatasetConfig(
                dataset_builder=dataset,
                teacher_config=TeacherConfig(base_model=server["teacher"]),
                groups_per_batch=2,
            )
        ],
        model_name=server["student"],
        recipe_name="ringtune_distillation_test",
        renderer_name=RENDERER,
        max_tokens=12,
        log_path=str(log_path),
        base_url=server["url"],
        eval_every=0,
        save_every=0,
        max_steps=STEPS,
    )
    asyncio.run(train_on_policy.main(config))

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kl = [r["teacher_kl"] for r in rows if "teacher_kl" in r]
    print(f"teacher_kl by step: {[round(k, 4) for k in kl]}")
    assert len(kl) == STEPS, rows
    assert all(torch.isfinite(torch.tensor(kl))), kl
    assert kl[0] > 0.5, kl  # the teacher is another model: far from the student at first (measured 1.11-1.54)
    assert kl[-1] < 0.7 * kl[0], kl  # the student learnt the teacher's class preference (measured 0.002-0.019 x)
