"""Connection-level tricks the fault injection needs: cutting a socket and noticing a hang-up.

ASGI hides the socket, so the simulator's uvicorn protocol (``server.SimHttpToolsProtocol``)
puts the transport into ``scope["extensions"]``. Under another server, cutting falls back to
raising, which makes the server close the connection (or answer 500 if nothing was sent yet).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive

TRANSPORT_KEY = "gateway.sim.transport"
_DISCONNECT_GRACE_S = 2.0


class ConnectionCut(Exception):
    """Raised when the socket cannot be reached: the server then drops the connection itself."""


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client hangs up; call it once the request body has been read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cut_connection(scope: dict[str, Any], receive: Receive) -> None:
    """Close the client's connection abruptly, mid-response or before any byte of it."""
    transport = scope.get("extensions", {}).get(TRANSPORT_KEY)
    if transport is None:
        raise ConnectionCut("simulated connection cut")
    # Frames already "sent" must reach the client before the cut; abort() would discard them.
    loop = asyncio.get_running_loop()
    flush_deadline = loop.time() + _DISCONNECT_GRACE_S
    while transport.get_write_buffer_size() and loop.time() < flush_deadline:
        await asyncio.sleep(0.005)
    transport.abort()
    # Wait for uvicorn to notice, so it does not try to answer 500 on a dead socket.
    try:
        await asyncio.wait_for(wait_disconnect(receive), _DISCONNECT_GRACE_S)
    except asyncio.TimeoutError:
        pass
