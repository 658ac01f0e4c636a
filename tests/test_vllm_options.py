"""``serve --sampler`` and the ``--vllm-*`` options -> the engine's config and command line (no engine started)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from test_vllm_engine import STAND_IN
from vllm_fixtures import live_group_members

from ringtune.cli import build_parser
from ringtune.errors import UserInputError
from ringtune.worker.vllm_options import PYTHON_ENV, SERVED_NAME, engine_configs, start_sampling_engines


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def engine_config(args, **kwargs):
    """The one engine of a one-model ``args`` (None for ``--sampler builtin``)."""
    configs = engine_configs(args, **kwargs)
    if not configs:
        return None
    (group,) = configs.values()
    (config,) = group
    return config


def test_builtin_is_the_default_and_starts_no_engine(tmp_path):
    args = _serve_args()
    assert args.sampler == "builtin"
    assert engine_config(args, dtype="float32", root=tmp_path) is None


def test_vllm_engine_config_and_command(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv(PYTHON_ENV, "/opt/engine/bin/python")
    args = _serve_args(
        "--model", str(model), "--sampler", "vllm", "--vllm-args", "--enforce-eager --seed 3", "--vllm-devices", "4,5"
    )
    config = engine_config(args, dtype="bf16-mixed", root=tmp_path)
    assert config is not None and config.python == "/opt/engine/bin/python" and config.url is None
    assert config.dtype == "bfloat16" and config.enable_lora and config.env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    command = config.command(port=8123)
    assert command[:3] == ["/opt/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for part in (f"--model {model}", f"--served-model-name {SERVED_NAME}", "--port 8123", "--dtype bfloat16"):
        assert part in joined
    assert "--enable-lora" in command and command[-3:] == ["--enforce-eager", "--seed", "3"]
    assert (tmp_path / ".vllm").is_dir() and config.log_path == str(tmp_path / ".vllm" / "engine.log")

    no_lora = engine_config(
        _serve_args("--model", str(model), "--sampler", "vllm", "--no-vllm-lora"), dtype="float64", root=tmp_path
    )
    assert no_lora is not None and not no_lora.enable_lora and no_lora.dtype == "float32"
    assert "--enable-lora" not in no_lora.command(port=1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sampler", "vllm"], "must be an HF checkpoint directory"),  # the embedded GGUF model
        (["--sampler", "vllm", "--model", "x.gguf"], "must be an HF checkpoint directory"),
    ],
)
def test_vllm_refusals_name_the_option(tmp_path, argv, message):
    with pytest.raises(UserInputError, match=message):
        engine_config(_serve_args(*argv), dtype="float32", root=tmp_path)


def test_bad_lora_rank_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = _serve_args("--model", str(tmp_path), "--sampler", "vllm", "--vllm-max-lora-rank", "0")
    with pytest.raises(UserInputError, match="--vllm-max-lora-rank=0"):
        engine_config(args, dtype="float32", root=tmp_path)


def _model(root, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path)


def test_several_engines_urls_and_models(tmp_path):
    one, two = _model(tmp_path, "one"), _model(tmp_path, "two")
    args = _serve_args("--model", one, "--sampler", "vllm", "--vllm-engines", "2", "--vllm-devices", "2,3")
    (group,) = engine_configs(args, dtype="float32", root=tmp_path, ranks_on_host=2, gpus_on_host=4).values()
    assert [c.env for c in group] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    assert [c.log_path for c in group] == [str(tmp_path / ".vllm" / f"engine-{i}.log") for i in range(2)]
    attached = _serve_args("--model", one, "--sampler", "vllm", "--vllm-url", "http://a:1", "--vllm-url", "http://b:2")
    (group,) = engine_configs(attached, dtype="float32", root=tmp_path).values()
    assert [c.url for c in group] == ["http://a:1", "http://b:2"]  # a model with URLs starts none by default
    argv = ["--model", f"s={one}", "--model", f"t={two}", "--sampler", "vllm", "--vllm-url", "t=http://t:1"]
    configs = engine_configs(_serve_args(*argv), dtype="float32", root=tmp_path)
    assert {name: [(c.model, c.url) for c in group] for name, group in configs.items()} == {
        "s": [(one, None)],
        "t": [(two, "http://t:1")],
    }
    assert configs["s"][0].log_path == str(tmp_path / ".vllm" / "engine-s-0.log")
    mixed = engine_configs(_serve_args(*argv, "--vllm-engines", "1"), dtype="float32", root=tmp_path)
    assert [c.url for c in mixed["t"]] == ["http://t:1", None]  # attached first, then the started one


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--vllm-url", "http://x:1"], "name the model it serves"),
        (["--vllm-url", "u=http://x:1"], "'u' is not a served model"),
        (["--vllm-url", "s=x:1"], "expected \\[MODEL=\\]http://host:port"),
        (["--vllm-engines", "-1"], "--vllm-engines=-1 must be >= 0"),
        (["--vllm-engines", "0", "--vllm-url", "s=http://x:1"], "model 't' has no --vllm-url either"),
    ],
)
def test_several_models_refusals_name_the_flag(tmp_path, extra, message):
    one, two = _model(tmp_path, "one"), _model(tmp_path, "two")
    args = _serve_args("--model", f"s={one}", "--model", f"t={two}", "--sampler", "vllm", *extra)
    with pytest.raises(UserInputError, match=message):
        engine_configs(args, dtype="float32", root=tmp_path)


class _Backend:
    """The served models' names and contexts, and whether it was closed."""

    def __init__(self, contexts: dict[str, int]) -> None:
        self.contexts, self.closed = contexts, False

    def models(self):
        return tuple(SimpleNamespace(model_name=n, context_length=c) for n, c in self.contexts.items())

    def info(self):
        return self.models()[0]

    def close(self):
        self.closed = True


def test_start_sampling_engines_starts_each_models_engines_or_none(tmp_path):
    launcher = tmp_path / "python"  # the stand-in server of test_vllm_engine, whatever module it is asked for
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "stand_in.py"} "$@"\n')
    launcher.chmod(0o755)
    one, two = _model(tmp_path, "one"), _model(tmp_path, "two")
    argv = ["--model", f"s={one}", "--model", f"t={two}", "--sampler", "vllm", "--vllm-python", str(launcher)]
    configs = engine_configs(_serve_args(*argv, "--vllm-engines", "2"), dtype="float32", root=tmp_path)
    backend = _Backend({"s": 64, "t": 128})
    engines = start_sampling_engines(configs, backend)
    try:
        assert engines is not None and [len(engines[m]) for m in ("s", "t")] == [2, 2]
        assert all(e.state == "serving" for group in engines.values() for e in group)
        assert {m: {e.config.max_model_len for e in group} for m, group in engines.items()} == {"s": {64}, "t": {128}}
        time.sleep(0.5)  # the processes outlive any helper thread: they were spawned from this one
        assert all(e.healthy() for group in engines.values() for e in group)
    finally:
        pids = [e.process_id() for group in (engines or {}).values() for e in group]
        for group in (engines or {}).values():
            for engine in group:
                engine.stop()
    assert all(pid is not None and live_group_members(pid) == [] for pid in pids)
    assert start_sampling_engines({}, backend) is None and not backend.closed
    broken = [replace(c, python="/nonexistent/python") for c in configs["t"]]
    with pytest.raises(OSError):
        start_sampling_engines({"s": configs["s"], "t": broken}, backend)
    assert backend.closed
