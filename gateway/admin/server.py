"""Run the admin app as a second server in the running event loop, on the gateway's own HTTP server.

The admin port gets the same bounds as the public one (head size, timeouts, connection cap, no
upgrades). The socket is bound here first: a busy port is an ``OSError`` with the address in it,
raised before anything is announced.
"""

from __future__ import annotations

import socket
from typing import Any

from ..config import ServerConfig
from ..responses import ASGIApp


class RunningServer:
    def __init__(self, serving: Any, sock: socket.socket):
        self._serving = serving
        self._sock = sock
        self.port: int = sock.getsockname()[1]

    async def stop(self) -> None:
        await self._serving.stop()
        self._sock.close()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def start_server(app: ASGIApp, host: str, port: int, server: ServerConfig | None = None, drain: float = 5.0) -> RunningServer:
    """Serve ``app`` on host:port in this loop until ``stop()``; no lifespan, no signal handlers."""
    from ..server import start

    sock = bind(host, port)
    serving = await start(app, server or ServerConfig(), drain=drain, sockets=[sock])
    return RunningServer(serving, sock)
