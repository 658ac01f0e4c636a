"""ringtune.worker.vllm_engine without vLLM: a stand-in server (a small HTTP script started exactly as the engine
would be: ``<python> -m vllm.entrypoints.openai.api_server ... --port P``, with a child process like vLLM's engine
core) is started, health-checked, restarted after a SIGKILL, and stopped with its whole process group; an attached
server is never started or stopped, and serves again once it answers."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from vllm_fixtures import live_group_members

from ringtune.worker.vllm_engine import EngineUnavailableError, VllmEngine, VllmEngineConfig

STAND_IN = """
import http.server, json, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
state = {"up": True}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine core

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(200 if state["up"] else 503, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"null")
        if self.path == "/down":
            state["up"] = False
        if self.path == "/up":
            state["up"] = True
        self._answer(200, {"path": self.path, "body": body, "argv": sys.argv[1:]})

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def stand_in_python(tmp_path) -> str:
    """An executable that runs the stand-in server whatever module it is asked for (as ``python -m ...``)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def _config(**kwargs) -> VllmEngineConfig:
    options = {"model": "/models/base", "served_name": "base", "health_interval_s": 0.1, "start_timeout_s": 60.0}
    return VllmEngineConfig(**(options | kwargs))


def test_started_engine_restarts_after_a_kill_and_stops_with_its_group(stand_in_python, tmp_path: Path):
    engine = VllmEngine(_config(python=stand_in_python, log_path=str(tmp_path / "engine.log"), max_restarts=1))
    engine.start()
    try:
        assert engine.state == "serving" and engine.incarnation == 1
        answer = engine.post("/v1/completions", {"prompt": [1, 2]})
        assert answer["body"] == {"prompt": [1, 2]} and "--enable-lora" in answer["argv"]
        first = engine.process_id()
        assert first is not None and len(live_group_members(first, wait_s=0)) >= 2  # the server and its child
        os.killpg(first, signal.SIGKILL)
        _wait(lambda: engine.incarnation == 2 and engine.state == "serving")
        assert engine.restarts == 1 and engine.process_id() != first and live_group_members(first) == []
        assert engine.post("/v1/completions", {"prompt": [3]})["body"] == {"prompt": [3]}
        os.killpg(engine.process_id(), signal.SIGKILL)  # past max_restarts: it stays down, calls fail at once
        _wait(lambda: engine.state == "failed")
        with pytest.raises(EngineUnavailableError, match="failed"):
            engine.post("/v1/completions", {})
    finally:
        second = engine.process_id()
        engine.stop()
    assert engine.state == "closed" and second is not None and live_group_members(second) == []


def test_attached_engine_is_never_started_or_stopped(stand_in_python, tmp_path: Path):
    server = VllmEngine(_config(python=stand_in_python, max_restarts=0))  # the operator's engine: kept as it is
    server.start()
    try:
        attached = VllmEngine(_config(url=server.url + "/", max_restarts=5))
        attached.start()
        assert attached.process_id() is None and attached.state == "serving" and attached.incarnation == 1
        attached.post("/down")
        _wait(lambda: attached.state == "failed")
        with pytest.raises(EngineUnavailableError):
            attached.check_serving()
        httpx.post(f"{server.url}/up", json=None)  # the operator's engine answers again: a new incarnation
        _wait(lambda: attached.state == "serving")
        assert attached.incarnation == 2 and attached.restarts == 0
        attached.stop()
        assert server.healthy()  # stopping the attached one left the server running
    finally:
        server.stop()


def test_a_start_that_fails_says_so(tmp_path: Path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho no vllm here >&2\nexit 3\n")
    broken.chmod(0o755)
    engine = VllmEngine(_config(python=str(broken), log_path=str(tmp_path / "engine.log")))
    with pytest.raises(EngineUnavailableError, match="exited with code 3 while starting"):
        engine.start()
    engine.stop()
    assert "no vllm here" in (tmp_path / "engine.log").read_text()


def _server_of(leader: int) -> int:
    """The API server: the group leader's child (engine_group_leader runs it)."""
    children = [pid for pid in live_group_members(leader, wait_s=0) if _parent_of(pid) == leader]
    assert len(children) == 1, children
    return children[0]


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_server_killed_alone_takes_its_engine_core_with_it(stand_in_python, tmp_path: Path):
    """vLLM's engine core outlives a SIGKILLed API server: the group leader ends the rest of the group, so the
    restart leaves nothing behind (before the leader, every crash left ~2 GiB of vLLM processes)."""
    engine = VllmEngine(_config(python=stand_in_python, max_restarts=1))
    engine.start()
    try:
        first = engine.process_id()
        assert first is not None
        server = _server_of(first)
        assert len(live_group_members(first, wait_s=0)) == 3  # leader, server, its child
        os.kill(server, signal.SIGKILL)  # the server alone, as a crash would
        _wait(lambda: engine.incarnation == 2 and engine.state == "serving")
        assert live_group_members(first) == []
    finally:
        engine.stop()


KILLED_PARENT = """
import sys, time
from ringtune.worker.vllm_engine import VllmEngine, VllmEngineConfig
engine = VllmEngine(VllmEngineConfig(model="/models/base", served_name="base", python=sys.argv[1]))
engine.start()
print(engine.process_id(), flush=True)
time.sleep(600)
"""


def test_a_killed_ringtune_leaves_no_engine_behind(stand_in_python, tmp_path: Path):
    """ringtune SIGKILLed (no atexit, no stop): PR_SET_PDEATHSIG tells the group leader, which ends its group."""
    import subprocess

    script = tmp_path / "parent.py"
    script.write_text(KILLED_PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, str(script), stand_in_python], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        leader = int(parent.stdout.readline())
        assert len(live_group_members(leader, wait_s=0)) == 3
    finally:
        parent.kill()
        parent.wait()
    assert live_group_members(leader, wait_s=30.0) == []
