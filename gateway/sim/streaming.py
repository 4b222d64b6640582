"""The SSE response: writes frames as the engine makes them and aborts the engine work when the
client hangs up, like lmdeploy's request cleanup, so a disconnect frees the batch slot at once.

It can also die on purpose: with ``crash_after`` set it cuts the connection after that many
frames, with no final event and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from starlette.types import Receive, Scope, Send

from .connection import cut_connection, wait_disconnect

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStream:
    def __init__(self, frames: AsyncGenerator[bytes, None], abort: Callable[[], None], crash_after: int | None = None) -> None:
        self.frames = frames
        self.abort = abort  # stops every unfinished sequence of the request; safe to call twice
        self.crash_after = crash_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        hangup = asyncio.ensure_future(wait_disconnect(receive))
        # Abort from the callback: the frame generator may be parked on an engine step.
        hangup.add_done_callback(lambda _: self.abort())
        sent = 0
        try:
            if self.crash_after == 0:
                await self._crash(scope, receive, hangup)
                return
            async for frame in self.frames:
                if hangup.done():
                    return
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                sent += 1
                if self.crash_after is not None and sent >= self.crash_after:
                    await self._crash(scope, receive, hangup)
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.frames.aclose()
            if not hangup.done():
                hangup.cancel()
            self.abort()

    async def _crash(self, scope: Scope, receive: Receive, hangup: asyncio.Future[None]) -> None:
        self.abort()
        hangup.cancel()  # cut_connection waits for the hang-up itself
        await cut_connection(scope, receive)
