"""The listener: one pure ASGI callable that runs a request down the chain.

    request line  -> PathPolicy        (canonical target, exact route match)
    headers       -> ApiKeyAuth        (before any body byte is read)
                  -> BodyPolicy        (content type, declared length)
    body          -> BodyPolicy.parse  (strict JSON, caps, engine knobs removed)
                  -> model access      (the key's model list)
                  -> MediaPolicy       (every media URL base64 or on an allowed domain)
                  -> Router            (balancer, upstream, relay)

Every refusal is rendered in the route's error shape. No client header other than an allow-list
is forwarded, and the upstream path is the route table's constant.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import orjson

from . import metrics
from .errors import Refusal
from .filters import RequestContext
from .filters.auth import key_id, model_allowed
from .routes import Route
from .routing.router import model_not_found
from .upstream import FORWARD_REQUEST_HEADERS

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("gateway.listener")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._\-]{1,64}$")
_JSON = (b"content-type", b"application/json")
_BAD_METHOD_LINE = Refusal(400, "Malformed request.", "malformed_request", code="invalid_request")


class _ClientGone(Exception):
    pass


class Listener:
    def __init__(self, gateway: "Gateway"):
        self.gw = gateway
        self.paths = gateway.paths
        self.auth = gateway.auth
        self.body = gateway.body
        self.media = gateway.media
        self.router = gateway.router
        self.max_body = gateway.config.limits.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.handle(scope, receive, send)
        elif kind == "lifespan":
            await self.lifespan(receive, send)
        # websockets and anything else: not served (uvicorn closes the connection)

    # -- lifespan ---------------------------------------------------------------------------
    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.gw.startup()
                except Exception as exc:
                    log.error("start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.gw.shutdown()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    # -- one request ------------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        resolved = self.paths.resolve(scope["method"], scope.get("raw_path") or scope["path"].encode("latin-1", "replace"), scope["path"])
        if isinstance(resolved, Refusal):
            await self._refuse(send, resolved, "openai")
            return
        route: Route = resolved
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            if name in headers:
                headers[name] += b"\x00" + value  # marks a repeated header; auth and body refuse those
            else:
                headers[name] = value
        ctx = RequestContext(scope, route, headers)
        refusal = self.auth.check(ctx)
        if refusal is not None:
            await self._refuse(send, refusal, route.style)
            return
        if not route.forward:
            await self.gw.answer_local(ctx, send)
            return
        refusal = self.body.check_headers(ctx)
        if refusal is not None:
            await self._refuse(send, refusal, route.style)
            return
        try:
            raw = await self._read_body(receive)
        except _ClientGone:
            return
        if raw is None:
            await self._refuse(send, self.body.too_large, route.style)
            return
        refusal = self.body.parse(ctx, raw)
        if refusal is None and not model_allowed(ctx.key, ctx.model or ""):
            refusal = model_not_found(ctx.model or "")
        if refusal is None and self.media is not None:
            refusal = self.media.check_body(ctx)
        if refusal is not None:
            await self._refuse(send, refusal, route.style)
            return
        payload = self.body.serialise(ctx.body)  # type: ignore[arg-type]
        if isinstance(payload, Refusal):
            await self._refuse(send, payload, route.style)
            return
        status = await self._forward(ctx, payload, receive, send)
        metrics.REQUESTS.labels(route=route.kind, status=f"{status // 100}xx").inc()
        metrics.LATENCY.labels(route=route.kind).observe(time.monotonic() - started)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the size cap (we stop reading there)."""
        first = await receive()
        if first["type"] != "http.request":
            raise _ClientGone()
        body = first.get("body", b"")
        if not first.get("more_body", False):
            return body if len(body) <= self.max_body else None
        parts = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _forward(self, ctx: RequestContext, payload: bytes, receive: Receive, send: Send) -> int:
        rid = ctx.headers.get(b"x-request-id")
        if rid is None or not _REQUEST_ID.match(rid):
            rid = secrets.token_hex(8).encode()
        headers = [_JSON, (b"x-request-id", rid)]
        for name in FORWARD_REQUEST_HEADERS:
            value = ctx.headers.get(name)
            if value is not None and b"\x00" not in value:
                headers.append((name, value))

        state = {"done": False, "gone": False}
        task = asyncio.current_task()

        async def send_tracked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"].append((b"x-request-id", rid))
            elif not message.get("more_body", False):
                state["done"] = True
            await send(message)

        async def reply(refusal: Refusal) -> None:
            await self._refuse(send_tracked, refusal, ctx.style)

        async def watch() -> None:
            # A client that goes away must cancel the upstream request: that frees the GPU.
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["done"] and task is not None:
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            return await self.router.forward(ctx, payload, headers, send_tracked, reply)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            if hasattr(task, "uncancel"):
                task.uncancel()  # type: ignore[union-attr]
            metrics.CLIENT_DISCONNECTS.inc()
            log.info("client went away; upstream request cancelled (key %s)", key_id(ctx.key.hash) if ctx.key else "-")
            return 499
        finally:
            watcher.cancel()

    async def _refuse(self, send: Send, refusal: Refusal, style: str) -> None:
        metrics.REFUSALS.labels(reason=refusal.reason).inc()
        body = refusal.body(style)
        headers = [_JSON, (b"content-length", str(len(body)).encode()), *refusal.headers]
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, data: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps(data)
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
