"""``timeout``: ``asyncio.timeout`` on Python 3.11+, the maintained ``async-timeout`` package on 3.10.

Both raise the builtin ``TimeoutError`` when the deadline passes (on 3.10 ``async-timeout`` raises
``asyncio.TimeoutError``, a different class there, so it is translated once, here).

``nodelay``: TCP_NODELAY on a transport's socket, whatever the event loop. uvloop sets it on every
TCP transport; stdlib asyncio only on sockets whose ``proto`` is IPPROTO_TCP, which excludes those
accepted from a listening socket made with ``socket.socket(family, SOCK_STREAM)`` (proto 0). Without
it Nagle holds a small write (an SSE chunk) back until the previous one is acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from typing import AsyncIterator


@contextlib.asynccontextmanager
async def _from_async_timeout(delay: float | None) -> AsyncIterator[None]:
    from async_timeout import timeout as async_timeout

    try:
        async with async_timeout(delay):
            yield
    except asyncio.TimeoutError:
        raise TimeoutError from None


if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - Python 3.10
    timeout = _from_async_timeout

__all__ = ["timeout"]


def nodelay(transport: asyncio.BaseTransport) -> None:
    """Send each write at once (TCP_NODELAY); a no-op for non-TCP transports."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is already gone: nothing left to send
            pass
