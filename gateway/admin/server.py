"""Run an ASGI app as a second server in the running event loop (today on uvicorn).

The admin listener is an ASGI app plus this small start function, so it can move to another
server without touching the app. The socket is bound here first: a busy port is an ``OSError``
with the address in it, raised before anything is announced.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from ..responses import ASGIApp


class RunningServer:
    def __init__(self, server: Any, task: asyncio.Task[None], sock: socket.socket):
        self._server = server
        self._task = task
        self._sock = sock
        self.port: int = sock.getsockname()[1]

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._task
        await self._server.shutdown(sockets=[self._sock])
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


async def start_server(app: ASGIApp, host: str, port: int) -> RunningServer:
    """Serve ``app`` on host:port in this loop until ``stop()``; no lifespan, no signal handlers."""
    import uvicorn

    sock = bind(host, port)
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False, proxy_headers=False)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    task = asyncio.get_running_loop().create_task(server.main_loop(), name=f"admin server :{sock.getsockname()[1]}")
    return RunningServer(server, task, sock)
