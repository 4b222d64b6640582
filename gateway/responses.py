"""ASGI types and the two small responses every part of the gateway writes: JSON and a refusal.

They live at the bottom so that the listener, the local routes and the admin listener can all
answer without importing one another.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import orjson

from . import metrics
from .errors import Refusal

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_CONTENT_TYPE = (b"content-type", b"application/json")


async def send_json(send: Send, status: int, data: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps(data)
    headers = [JSON_CONTENT_TYPE, (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def refuse(send: Send, refusal: Refusal, style: str = "openai", close: bool = False) -> int:
    """Write ``refusal`` in the route's error shape, count it by reason; returns the status sent."""
    metrics.REFUSALS.labels(reason=refusal.reason).inc()
    body = refusal.body(style)
    headers = [JSON_CONTENT_TYPE, (b"content-length", str(len(body)).encode()), *refusal.headers]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return refusal.status
