"""``ringtune serve`` in a subprocess: it prints the SDK settings, serves the SDK, and stops on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import tinker
from gateway_fixtures import tiny_model_dir

from ringtune.gateway.server import free_port


def test_serve_prints_the_sdk_settings_and_serves(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "models" / "tiny")
    port = free_port()
    command = [sys.executable, "-m", "ringtune.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--checkpoint-root", str(tmp_path / "ckpt"), "--api-key", "tml-cli", "--context-length", "64"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any("TINKER_BASE_URL=" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        settings = dict(part.split("=", 1) for part in lines[-1].split())
        assert settings == {"TINKER_BASE_URL": f"http://127.0.0.1:{port}", "TINKER_API_KEY": "tml-cli"}
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz").status_code == 200:
                    break
            except httpx.ConnectError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        with tinker.ServiceClient(base_url=settings["TINKER_BASE_URL"], api_key=settings["TINKER_API_KEY"]) as sc:
            tc = sc.create_lora_training_client(str(model_dir), rank=0).result()
            datum = tinker.Datum(
                model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
            )
            assert tc.forward([datum], "cross_entropy").result().metrics["num_tokens:sum"] == 3.0
            assert tc.get_info().model_data.tokenizer_id == str(model_dir.resolve())
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    # uvicorn shuts down (lifespan: the service and backend close), then re-raises SIGINT
    assert proc.returncode in (0, -signal.SIGINT), rest
    assert "Application shutdown complete" in rest, rest


def test_serve_process_moves_to_a_fresh_port_when_its_port_was_taken(tmp_path, monkeypatch):
    """Servers started side by side: the port ``ServeProcess`` picked is bound by someone else before the child
    binds it (made deterministic here by holding it). The child's bind fails; the server starts on a fresh port."""
    import socket

    from ringtune.gateway import serve_process

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    picks = iter([held])
    monkeypatch.setattr(serve_process, "free_port", lambda: next(picks, None) or free_port())
    proc = serve_process.ServeProcess(
        str(tiny_model_dir(tmp_path / "model")),
        checkpoint_root=tmp_path / "ckpt",
        log_path=tmp_path / "serve.log",
        extra_args=["--context-length", "64"],
    )
    try:
        with proc:
            assert proc.port != held and httpx.get(f"{proc.url}/api/v1/healthz").status_code == 200
    finally:
        taken.close()
