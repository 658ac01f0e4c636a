"""``ringtune demo`` end to end on a tiny random Llama with SmolLM2's tokenizer: a ``ringtune serve`` child,
the real tinker SDK over 127.0.0.1 at CP=2 (the demo's default: the server spawns a second rank), the PNG and
metrics it writes, and the server's whole process group stopped on every exit (normal end and Ctrl-C). The
embedded SmolLM2-135M run is `make demo` (minutes; not a test)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from smollm_fixtures import tiny_smollm_dir

from ringtune.cli import main
from ringtune.demo.config import LORA_LEARNING_RATE, DemoConfig
from ringtune.demo.data import load_conversations, render_chatml, split_held_out
from ringtune.demo.run import run_demo
from ringtune.errors import UserInputError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_smollm_dir(tmp_path_factory.mktemp("demo-model") / "tiny-smollm")


def _gone(pid: int) -> bool:
    """True when no process of the group ``pid`` leads is left (the server and the ranks it spawned)."""
    try:
        os.killpg(pid, 0)  # the server runs in its own session: its pid is its process group id
    except ProcessLookupError:
        return True
    return False


def test_packaged_data_renders_with_the_served_tokenizer(model_dir):
    from transformers import AutoTokenizer

    conversations = load_conversations()
    train, held_out = split_held_out(conversations)
    assert len(conversations) >= 300 and len(held_out) == len(conversations) // 8
    assert not {json.dumps(c) for c in train} & {json.dumps(c) for c in held_out}
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    example = render_chatml(conversations[0], tokenizer)
    reply = conversations[0][-1]["content"] + "<|im_end|>"
    weighted = [t for t, w in zip(example.tokens, example.weights, strict=True) if w == 1.0]
    assert tokenizer.decode(weighted) == reply  # exactly the reply and its end token are trained on
    assert example.tokens[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # ChatML tokens are single ids
    datum = example.datum()
    assert datum.model_input.length == len(example.tokens) - 1
    assert datum.loss_fn_inputs["target_tokens"].tolist() == example.tokens[1:]


def test_bad_settings_name_field_value_and_limit(tmp_path):
    with pytest.raises(UserInputError, match=r"steps=0 must be >= 1"):
        DemoConfig(steps=0).validate()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(UserInputError, match=r"bad.jsonl:1: .*ending with an assistant message"):
        load_conversations(bad)


def test_demo_trains_plots_and_stops_the_server(model_dir, tmp_path):
    lines: list[str] = []
    config = DemoConfig(steps=3, cp=2, out=str(tmp_path / "out"), model=str(model_dir), learning_rate=1e-3)
    result = run_demo(config, progress=False, log=lines.append)
    png = tmp_path / "out" / "loss_curve.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss curve: {png}" in lines
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert len(metrics["train_nll"]) == 3 and metrics["cp"] == 2
    assert all(math.isfinite(x) for x in [*metrics["train_nll"], metrics["held_out_nll_before"]])
    assert math.isfinite(metrics["held_out_nll_after"])
    assert [step for step, _ in metrics["held_out_curve"]] == [0, 3]
    assert set(metrics["samples"]) == {"before", "after"}  # greedy replies through the sampler, both printed
    assert any(line.startswith("sample before fine-tuning:") for line in lines)
    assert any(line.startswith("sample after fine-tuning:") for line in lines)
    # a random model starts near ln(49152) = 10.8; three AdamW steps at 1e-3 already move the held-out NLL
    assert 9.0 < result.held_out_nll_before < 12.0 and result.improved, metrics
    pid = int(next(line for line in lines if "server ready" in line).split("pid ")[1].rstrip(")"))
    assert _gone(pid), f"server {pid} (or a rank it spawned) still running after the demo"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["steps"] == 3


def test_ctrl_c_stops_the_server(model_dir, tmp_path):
    command = [sys.executable, "-m", "ringtune.cli", "demo", "--model", str(model_dir), "--cp", "2"]
    command += ["--steps", "100000", "--eval-every", "0", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
    )
    lines: list[str] = []
    pid = None
    try:
        deadline = time.monotonic() + 240  # slow is not dead: a busy 2-core machine
        while not any("held-out NLL per token before" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            if "server ready" in line:
                pid = int(line.split("pid ")[1].split(")")[0])
        assert pid is not None and not _gone(pid)
        time.sleep(1.0)  # inside the training loop now
        proc.send_signal(signal.SIGINT)
        # the server drains first (the step running completes, results wait DRAIN_GRACE_S, a long poll may
        # hold its connection up to poll_timeout_s) and ServeProcess.stop escalates to SIGTERM after 60 s, so the
        # bound is the stop's own worst case plus slack (the earlier timeouts were a demo started with SIGINT
        # ignored, as background jobs of non-interactive shells are: main_demo now installs the handler)
        try:
            rest, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER prints every thread's stack: where it hangs
            rest, _ = proc.communicate(timeout=30)
            pytest.fail("the demo did not exit within 240 s of its Ctrl-C; its threads:\n" + rest[-20000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(lines) + rest
    assert "interrupted: the server was stopped" in rest
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"server {pid} (or a rank it spawned) survived the demo's Ctrl-C"


def test_demo_with_a_lora_rank(model_dir, tmp_path):
    """``ringtune demo --lora-rank 8``: the same job as a LoRA run on the frozen base (the learning rate defaults to
    the LoRA one); its held-out NLL falls too."""
    out = tmp_path / "lora"
    args = ["demo", "--model", str(model_dir), "--cp", "2", "--steps", "3", "--eval-every", "0", "--out", str(out)]
    assert main([*args, "--lora-rank", "8"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["lora_rank"] == 8 and config["learning_rate"] == LORA_LEARNING_RATE
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["held_out_nll_after"] < metrics["held_out_nll_before"], metrics
    with pytest.raises(UserInputError, match=r"lora_rank=-1 must be in \[0, 1024\]"):
        DemoConfig(lora_rank=-1).validate()
