"""``ringtune serve`` as a child process: start it, wait until it answers, and always stop it.

The child runs in its own session (process group), so a Ctrl-C in the terminal reaches only the parent,
which then stops the child in order: SIGINT to the server (uvicorn's graceful shutdown closes the backend),
then SIGTERM and SIGKILL to whatever is left of its process group (ranks a multi-rank server spawned). On
Linux the child also gets SIGTERM if the parent dies without cleaning up (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from ringtune.gateway.server import free_port

READY_TIMEOUT_S = 600.0
"""How long the server may take to load the model and answer ``/healthz``."""
STOP_TIMEOUT_S = 60.0
"""How long a graceful SIGINT shutdown may take before SIGTERM / SIGKILL."""


class ServerStartError(RuntimeError):
    """``ringtune serve`` exited or did not answer in time; the message carries the tail of its log."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


PORT_ATTEMPTS = 3
"""Starts tried on fresh ports when the picked one was taken meanwhile (see :meth:`ServeProcess.start`)."""

PORT_TAKEN = "address already in use"
"""What uvicorn logs when the port is bound by another process."""


class ServeProcess:
    """A ``ringtune serve`` child on ``127.0.0.1:<port>``; use as ``with ServeProcess(...) as server``.

    Args:
        model: ``--model`` (HF dir, ``.gguf`` file or ``smollm2-135m``).
        checkpoint_root: ``--checkpoint-root`` (also holds the built tokenizer under ``.tokenizers``).
        log_path: the child's stdout and stderr go here (never a pipe: a full pipe would stall it).
        port: 0 picks a free port.
        api_key: ``--api-key`` (must start with ``tml-``).
        extra_args: more ``ringtune serve`` arguments (``--cp``, ``--context-length``, ``--dtype``, ...).
        env: more environment variables for the child (over this process's own), e.g. ``OMP_NUM_THREADS``.
    """

    def __init__(
        self,
        model: str,
        *,
        checkpoint_root: str | Path,
        log_path: str | Path,
        port: int = 0,
        api_key: str = "tml-local",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.any_port = not port  # a port we picked: another one is tried if it was taken meanwhile
        self.api_key = api_key
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.command = [
            sys.executable,
            "-m",
            "ringtune.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--checkpoint-root",
            str(checkpoint_root),
            "--api-key",
            api_key,
            "--log-level",
            "warning",
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The child server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the child wrote."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Spawn the child and wait until ``/api/v1/healthz`` answers 200; returns the base URL.

        Raises ServerStartError (with the log tail) if the child exits first or ``timeout_s`` passes. When the
        port was picked here (``port=0``) and another process bound it between the pick and the child's bind
        (servers started side by side), the child is started again on a fresh port, up to
        :data:`PORT_ATTEMPTS` times.
        """
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once(timeout_s)
            except ServerStartError:
                if not (self.any_port and attempt < PORT_ATTEMPTS and PORT_TAKEN in self.log_tail()):
                    raise
            old, self.port = self.port, free_port()
            self.command[self.command.index("--port") + 1] = str(self.port)
            print(f"ringtune serve: port {old} was taken meanwhile; trying {self.port}", file=sys.stderr)
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ | self.env | {"PYTHONUNBUFFERED": "1"},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            return self._wait_ready(self.proc, timeout_s)
        except BaseException:  # not ready, or Ctrl-C while loading: leave nothing behind
            self.stop()
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"ringtune serve exited with code {code} before serving (log {self.log_path}):\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2.0).status_code == 200:
                    return self.url
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"ringtune serve did not answer on {self.url} within {timeout_s:.0f} s (log {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.2)

    def _group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Stop the child and its process group (SIGINT, then SIGTERM, then SIGKILL); returns its exit code.

        Idempotent; safe to call from ``finally`` and after a KeyboardInterrupt.
        """
        proc = self.proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the child leads its own group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if not self._group_alive(pgid):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while self._group_alive(pgid) and time.monotonic() < deadline:
                proc.poll()  # reap the leader so the group can empty
                time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        return proc.returncode

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def worker_pids(pid: int) -> list[int]:
    """The worker-rank processes of the ``ringtune serve`` with pid ``pid`` (its children running
    ``multiprocessing.spawn``; Linux only: read from ``/proc``)."""
    out = []
    for child in map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
        try:
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text():
                out.append(child)
        except FileNotFoundError:
            continue
    return out
