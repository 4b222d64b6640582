"""The listener: one pure ASGI callable that runs a request down the chain.

    request line  -> PathPolicy        (canonical target, exact route match)
    headers       -> ApiKeyAuth        (before any body byte is read)
                  -> RateLimit         (per key)
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
from .filters.uploads import UPLOAD_BUSY, UploadBudget, UploadGrant
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
WATCH_AFTER = 0.02  # seconds before a request starts watching for its client to go away


_STATUS_CLASS = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}


def _printable(text: str, limit: int = 128) -> str:
    """Client-chosen text for a log line: escaped, so a decoded %0a cannot forge a line."""
    return text[:limit].encode("unicode_escape").decode("ascii").replace('"', '\\"')


def _has_body(ctx: RequestContext) -> bool:
    length = ctx.headers.get(b"content-length")
    return (length is not None and length != b"0") or b"transfer-encoding" in ctx.headers


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class _ClientGone(Exception):
    pass


class Listener:
    def __init__(self, gateway: "Gateway"):
        self.gw = gateway
        self.paths = gateway.paths
        self.auth = gateway.auth
        self.limits = gateway.limits
        self.body = gateway.body
        self.media = gateway.media
        self.router = gateway.router
        self.max_body = gateway.config.limits.max_body_bytes
        self.uploads = UploadBudget(gateway.config.limits.max_upload_bytes_per_key)
        self.access_log = gateway.config.server.access_log
        self._counters: dict[tuple[str, int], Any] = {}
        self._histograms: dict[str, Any] = {}

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
        ctx = self._context(scope)
        if isinstance(ctx, Refusal):
            await self._refuse(send, ctx, "openai")
            status, kind = ctx.status, "unrouted"
            ctx = None
        else:
            status, kind = await self._run(ctx, receive, send), ctx.route.kind
        counter = self._counters.get((kind, status // 100))
        if counter is None:  # labels() takes a lock and validates: look each child up once
            counter = self._counters[(kind, status // 100)] = metrics.REQUESTS.labels(route=kind, status=_STATUS_CLASS.get(status // 100, "other"))
        counter.inc()
        if kind != "unrouted":
            histogram = self._histograms.get(kind)
            if histogram is None:
                histogram = self._histograms[kind] = metrics.LATENCY.labels(route=kind)
            histogram.observe(time.monotonic() - started)
        if self.access_log:
            key = ctx.key if ctx is not None else None
            # Keys are named by their configured name and a short id of their hash, never by value.
            log.info(
                '%s "%s %s" %d %.1fms key=%s model=%s',
                _client(scope), scope["method"], _printable(scope["path"]), status, (time.monotonic() - started) * 1000,
                f"{key.name}/{key_id(key.hash)}" if key else "-", _printable((ctx.model if ctx is not None else None) or "-"),
            )

    def _context(self, scope: Scope) -> RequestContext | Refusal:
        raw_path = scope.get("raw_path") or scope["path"].encode("latin-1", "replace")
        resolved = self.paths.resolve(scope["method"], raw_path, scope["path"])
        if isinstance(resolved, Refusal):
            return resolved
        headers: dict[bytes, bytes] = {}
        repeated: dict[bytes, list[bytes]] | None = None
        for name, value in scope["headers"]:
            if name in headers:
                # Joined once at the end (linear); b"\x00" marks a repeated header, which auth and body refuse.
                if repeated is None:
                    repeated = {}
                repeated.setdefault(name, [headers[name]]).append(value)
            else:
                headers[name] = value
        if repeated:
            for name, values in repeated.items():
                headers[name] = b"\x00".join(values)
        return RequestContext(scope, resolved, headers)

    async def _run(self, ctx: RequestContext, receive: Receive, send: Send) -> int:
        """The chain for one routed request; returns the status the client got (499: it left)."""
        route = ctx.route
        refusal = self.auth.check(ctx)
        if refusal is None and self.limits.active:
            refusal = self.limits.check(ctx)
        if refusal is None and not route.forward:
            return await self.gw.answer_local(ctx, send)
        if refusal is None:
            refusal = self.body.check_headers(ctx)
        if refusal is not None:
            # The body was never read: the connection ends after the answer (the server drains what
            # the client still sends, bounded, so a client that writes its body first reads this).
            return await self._refuse(send, refusal, route.style, close=_has_body(ctx))
        grant = self.uploads.grant(ctx)
        if grant is None:
            return await self._refuse(send, UPLOAD_BUSY, route.style, close=True)
        try:
            return await self._run_body(ctx, grant, receive, send)
        finally:
            grant.release()  # the body is held until the request is over

    async def _run_body(self, ctx: RequestContext, grant: UploadGrant, receive: Receive, send: Send) -> int:
        route = ctx.route
        try:
            raw = await self._read_body(receive, grant)
        except _ClientGone:
            return 499
        if isinstance(raw, Refusal):
            return await self._refuse(send, raw, route.style, close=True)
        refusal = self.body.parse(ctx, raw)
        if refusal is None and not model_allowed(ctx.key, ctx.model or ""):
            refusal = model_not_found(ctx.model or "")
        if refusal is None:
            refusal = await self.media.check_body_async(ctx) if self.media.is_async else self.media.check_body(ctx)
        if refusal is not None:
            return await self._refuse(send, refusal, route.style)
        payload = self.body.serialise(ctx.body)  # type: ignore[arg-type]
        if isinstance(payload, Refusal):
            return await self._refuse(send, payload, route.style)
        return await self._forward(ctx, payload, receive, send)

    async def _read_body(self, receive: Receive, grant: UploadGrant) -> bytes | Refusal:
        """The whole body, or a refusal once it passes the size cap or the key's upload budget (we stop reading there)."""
        first = await receive()
        if first["type"] != "http.request":
            raise _ClientGone()
        body = first.get("body", b"")
        if not first.get("more_body", False):
            if len(body) > self.max_body:
                return self.body.too_large
            return body if grant.grow(len(body)) else UPLOAD_BUSY
        parts = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return self.body.too_large
            if not grant.grow(size):
                return UPLOAD_BUSY
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

        # Watching for the disconnect costs a task; a request that is over within WATCH_AFTER never
        # needs it, so the watcher starts only then (a timer handle is far cheaper than a task).
        loop = asyncio.get_running_loop()
        watcher: list[asyncio.Task[None]] = []
        timer = loop.call_later(WATCH_AFTER, lambda: watcher.append(loop.create_task(watch())))
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
            timer.cancel()
            if watcher:
                watcher[0].cancel()

    async def _refuse(self, send: Send, refusal: Refusal, style: str, close: bool = False) -> int:
        metrics.REFUSALS.labels(reason=refusal.reason).inc()
        body = refusal.body(style)
        headers = [_JSON, (b"content-length", str(len(body)).encode()), *refusal.headers]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return refusal.status


async def send_json(send: Send, status: int, data: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps(data)
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
