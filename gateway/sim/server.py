"""Process life: load delay, bind, serve with uvicorn, print the ready line, exit 0 on SIGTERM.

Like the real server, the port opens only once the "model" has loaded (``--startup-delay``), so a
launcher sees connection-refused first and must poll ``/health``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .app import build_app
from .config import SimConfig
from .connection import TRANSPORT_KEY


class SimHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that also hands the transport to the app, for fault injection."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope.setdefault("extensions", {})[TRANSPORT_KEY] = self.transport  # type: ignore[typeddict-item]


class SimServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready_line: str) -> None:
        super().__init__(config)
        self.ready_line = ready_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            # A launcher that stopped reading our stdout must not stop us from serving.
            with contextlib.suppress(OSError):
                print(self.ready_line, flush=True)


def _graceful_exit(signum: int, frame: FrameType | None) -> None:
    # uvicorn handles SIGTERM while serving, then re-raises it once shut down: end with 0 then.
    raise SystemExit(0)


def run(config: SimConfig) -> int:
    signal.signal(signal.SIGTERM, _graceful_exit)
    signal.signal(signal.SIGINT, _graceful_exit)
    if config.startup_delay > 0:
        time.sleep(config.startup_delay)
    uv_config = uvicorn.Config(
        build_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=SimHttpToolsProtocol,
        ws="none",
        lifespan="on",
        log_level=config.log_level,
        access_log=False,
        proxy_headers=False,  # the request log must show the client's headers untouched
        timeout_graceful_shutdown=config.graceful_timeout,
    )
    sock = uv_config.bind_socket()  # exits 3 with a log line if the port is taken
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    server = SimServer(uv_config, f"sim ready on http://{shown_host}:{port} model={config.model}")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        return 3  # lifespan startup failed; uvicorn has logged why
    return 0

