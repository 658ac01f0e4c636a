"""``ringtune serve`` refuses a configuration that cannot serve at start-up (exit 2, the message), before any rank
starts; modes left at their default are chosen to fit the model and the banner says so."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from support.tiny_models import hf_config

from ringtune.errors import UserInputError
from ringtune.worker.preflight import ServeSettings, preflight

HEADWISE_REFUSAL = "gated_delta mode headwise needs linear_num_key_heads=2 divisible by TP·CP=4; use chunkwise"


@pytest.fixture(scope="module")
def two_key_heads(tmp_path_factory) -> str:
    """A Qwen3.5 config with 2 GatedDeltaNet key heads (config.json only: the checks read no weights)."""
    config = hf_config("qwen3_5").to_dict()
    config["linear_num_key_heads"] = 2
    path = tmp_path_factory.mktemp("preflight") / "qwen3_5_2kh"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_explicit_mode_that_does_not_fit_is_refused(two_key_heads):
    with pytest.raises(UserInputError, match="--cp 4 --linear-cp-mode headwise cannot serve qwen3_5") as info:
        preflight(ServeSettings(source=two_key_heads, cp=4, gated_delta="headwise"))
    assert HEADWISE_REFUSAL in str(info.value)
    with pytest.raises(UserInputError, match="alltoall needs num_attention_heads=4 divisible by TP·CP=8"):
        preflight(ServeSettings(source=two_key_heads, cp=8, attention="alltoall", gated_delta="chunkwise"))


def test_default_modes_are_chosen_to_fit_and_noted(two_key_heads):
    fits = preflight(ServeSettings(source=two_key_heads, cp=2, max_tokens_per_rank=64))
    assert (fits.attention, fits.gated_delta, fits.notes) == ("ring", "headwise", ())
    chosen = preflight(ServeSettings(source=two_key_heads, cp=4, max_tokens_per_rank=64))
    assert (chosen.attention, chosen.gated_delta) == ("ring", "chunkwise")
    assert chosen.context_length == 256
    assert len(chosen.notes) == 1 and "chunkwise GDN" in chosen.notes[0] and HEADWISE_REFUSAL in chosen.notes[0]
    long = preflight(ServeSettings(source=two_key_heads, cp=2, max_tokens_per_rank=1024))
    assert "exceeds the model's max_position_embeddings=256" in long.notes[0]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"dtype": "float16"}, "--dtype='float16': choose one of"),
        ({"recompute": "some"}, "--recompute='some': choose one of"),
        ({"shard_params": "dp"}, "--shard-params=dp needs more than one rank"),
        ({"cp": 2, "ep": 2, "shard_params": "dp"}, "--shard-params=dp with --ep=2: under expert parallelism use"),
        ({"cp": 0}, "--cp=0 must be >= 1"),
        ({"max_tokens_per_rank": 7}, "--max-tokens-per-rank=7 holds no datum at CP=1; use >= 8"),
        ({"mesh_prompt_tokens": -1}, "--mesh-prompt-tokens=-1 must be >= 0"),
        ({"tokenizer_dir": "/nonexistent"}, "tokenizer dir '/nonexistent' has neither"),
        ({"source": "/nonexistent"}, "--model '/nonexistent': not an HF checkpoint directory"),
    ],
)
def test_each_setting_is_checked(two_key_heads, settings, needle):
    with pytest.raises(UserInputError) as info:
        preflight(ServeSettings(**{"source": two_key_heads, **settings}))
    assert needle in str(info.value)


def test_serve_exits_2_before_starting_ranks(two_key_heads, tmp_path):
    """The CLI prints the refusal and exits 2 in seconds: no rank process, no port, no healthz 200."""
    command = [sys.executable, "-m", "ringtune.cli", "serve", "--model", two_key_heads, "--cp", "4"]
    command += ["--linear-cp-mode", "headwise", "--checkpoint-root", str(tmp_path / "ckpt"), "--port", "1"]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert HEADWISE_REFUSAL in done.stderr and "error: --cp 4 --linear-cp-mode headwise" in done.stderr
    assert "TINKER_BASE_URL" not in done.stdout
    assert time.monotonic() - start < 60
