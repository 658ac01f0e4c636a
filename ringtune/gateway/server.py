"""Run a gateway: uvicorn in the foreground (``ringtune serve``) or in a background thread (tests, tools).

Shutdown (SIGTERM or SIGINT to ``ringtune serve``, :class:`DrainingServer`): the gateway first drains: new
compute requests and the ones still queued fail with ``category: server`` ("the server is shutting down"), the
request the backend is running completes (or fails) as usual, and HTTP keeps answering ``retrieve_future`` until
every result made since the signal was fetched or ``drain_grace_s`` passed; then uvicorn stops, the backend closes
(the worker ranks get ``shutdown`` and exit). A second signal skips the drain.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import FrameType

import uvicorn

from ringtune.gateway.app import create_app
from ringtune.gateway.backend import Backend
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.service import GatewayService
from ringtune.gateway.vllm_engines import Engines

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 10.0
"""After a shutdown signal, how long results made since then wait to be retrieved before HTTP stops."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def uvicorn_config(backend: Backend, config: GatewayConfig, host: str, port: int, log_level: str) -> uvicorn.Config:
    """The uvicorn config of a gateway over ``backend``: HTTP/1.1 (h11), no access log below ``info``."""
    return service_uvicorn_config(GatewayService(backend, config), host, port, log_level)


def service_uvicorn_config(service: GatewayService, host: str, port: int, log_level: str) -> uvicorn.Config:
    """The uvicorn config serving ``service`` (see :func:`uvicorn_config`)."""
    app = create_app(service)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        lifespan="on",
        timeout_keep_alive=75,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM / SIGINT drains the service before it stops (module docstring)."""

    def __init__(self, service: GatewayService, config: uvicorn.Config, *, grace_s: float = DRAIN_GRACE_S) -> None:
        super().__init__(config)
        self.service, self.grace_s = service, grace_s
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler: the first SIGTERM / SIGINT drains (module docstring), a second one exits."""
        if self._draining or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._captured_signals.append(sig)
        threading.Thread(target=self._drain, name="ringtune-drain", daemon=True).start()

    def _drain(self) -> None:
        since = time.monotonic()
        log.warning("shutting down: draining (the request running completes; queued and new ones fail)")
        try:
            self.service.drain()
            deadline = time.monotonic() + self.grace_s
            while self.service.futures.unsettled(since) and time.monotonic() < deadline and not self.should_exit:
                time.sleep(0.1)
        finally:
            self.should_exit = True


def serve(
    backend: Backend,
    config: GatewayConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    sampling_engine: Engines | None = None,
) -> None:
    """Serve until a signal (blocks): SIGTERM / SIGINT drain first (:class:`DrainingServer`); the backend (and
    ``sampling_engine``: the engine, or each served model's engines, that answer sampling when given: ``serve
    --sampler vllm``) is closed at shutdown."""
    service = GatewayService(backend, config, sampling_engine=sampling_engine)
    DrainingServer(service, service_uvicorn_config(service, host, port, log_level)).run()


class ServerThread:
    """A gateway on ``127.0.0.1:<free port>`` in a daemon thread: ``with ServerThread(backend, config) as url``."""

    def __init__(
        self,
        backend: Backend,
        config: GatewayConfig,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_level: str = "warning",
        sampling_engine: Engines | None = None,
    ) -> None:
        self.host, self.port, self.backend = host, port or free_port(host), backend
        self.service = GatewayService(backend, config, sampling_engine=sampling_engine)
        """The service behind the routes (tools may run work on its backend thread: ``service.executor``)."""
        self.server = uvicorn.Server(service_uvicorn_config(self.service, self.host, self.port, log_level))
        self.thread = threading.Thread(target=self.server.run, name="ringtune-gateway", daemon=True)

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Start and wait until it accepts connections; returns the base URL."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway on {self.url} did not start")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit (lifespan shutdown closes the service and backend) and join the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
