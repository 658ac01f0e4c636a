"""Run a gateway: uvicorn in the foreground (``ringtune serve``) or in a background thread (tests, tools)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from ringtune.gateway.app import create_app
from ringtune.gateway.backend import Backend
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.service import GatewayService


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


def serve(
    backend: Backend, config: GatewayConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve until interrupted (blocks); the backend is closed at shutdown."""
    uvicorn.Server(uvicorn_config(backend, config, host, port, log_level)).run()


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
    ) -> None:
        self.host, self.port, self.backend = host, port or free_port(host), backend
        self.service = GatewayService(backend, config)
        """The service behind the routes (tools may run work on its backend thread: ``service.executor``)."""
        self.server = uvicorn.Server(service_uvicorn_config(self.service, self.host, self.port, log_level))
        self.thread = threading.Thread(target=self.server.run, name="ringtune-gateway", daemon=True)

    @property
    def url(self) -> str:
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
