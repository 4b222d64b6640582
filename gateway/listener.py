"""The listener: one pure ASGI callable that runs a request down the chain.

    request line  -> PathPolicy        (canonical target, exact route match)
    headers       -> ApiKeyAuth        (before any body byte is read)
                  -> BodyPolicy        (content type, declared length)
    body          -> BodyPolicy.parse  (strict JSON, caps, engine knobs removed)
                  -> model access      (the key's model list)
                  -> MediaPolicy       (every media URL base64 or on an allowed domain)
                  -> RateLimit         (per key: rpm, tpm, concurrency, budget; settled at the end)
                  -> Router            (balancer, upstream, relay)

Every refusal is rendered in the route's error shape. No client header other than an allow-list
is forwarded, and the upstream path is the route table's constant.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from typing import Any, Awaitable, Callable

from . import logs, metrics, tracing
from .errors import Refusal, model_not_found
from .filters import RequestContext
from .filters.auth import ApiKeyAuth, model_allowed
from .filters.uploads import UPLOAD_BUSY, UploadBudget, UploadGrant
from .filters.body import BodyPolicy
from .filters.cors import CorsPolicy
from .filters.limits import RateLimit
from .filters.media import MediaPolicy
from .filters.paths import PathPolicy
from .leanmetrics import CounterChild, HistogramChild
from .local_routes import LocalRoutes
from .responses import JSON_CONTENT_TYPE as _JSON
from .responses import Receive, Scope, Send, refuse, send_json
from .routes import RouteAccess
from .routing.router import Router
from .server.protocol import DISCONNECT_EXTENSION
from .state.keys import key_id
from .upstream import FORWARD_REQUEST_HEADERS

log = logging.getLogger("gateway.listener")

__all__ = ["Listener", "Receive", "Scope", "Send", "refuse", "send_json"]

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._\-]{1,64}$")
WATCH_AFTER = 0.02  # seconds before a request starts watching for its client to go away (servers without DISCONNECT_EXTENSION)
_NO_EXTENSIONS: dict[str, Any] = {}


def _new_request_id() -> str:
    """16 hex digits. A correlation id, not a secret: the process's PRNG (reseeded in each forked
    worker) instead of secrets.token_hex, which costs a getrandom() syscall per request."""
    return "%016x" % random.getrandbits(64)


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


Lifecycle = Callable[[], Awaitable[None]]


class Listener:
    """The filter chain for one port; it is handed its collaborators and knows nothing of the wiring."""

    def __init__(
        self,
        *,
        paths: PathPolicy,
        auth: ApiKeyAuth,
        limits: RateLimit,
        body: BodyPolicy,
        media: MediaPolicy,
        local: LocalRoutes,
        router: Router,
        max_body: int,
        max_upload_per_key: int = 128 * 1024 * 1024,
        access_log: bool = False,
        startup: Lifecycle | None = None,
        shutdown: Lifecycle | None = None,
        cors: CorsPolicy | None = None,
        tracer: tracing.Tracing | None = None,
        observe: Callable[[RequestContext | None, int, float, str | None], None] | None = None,
    ):
        self.paths = paths
        self.auth = auth
        self.limits = limits
        self.body = body
        self.media = media
        self.local = local
        self.router = router
        self.max_body = max_body
        self.uploads = UploadBudget(max_upload_per_key)  # body bytes being received at once, per key
        self.access_log = access_log
        self._startup = startup
        self._shutdown = shutdown
        self.cors = cors
        self.tracer = tracer if tracer is not None and tracer.enabled else None
        self.observe = observe  # e.g. the admin listener's live stats: (ctx or None if unrouted, status, seconds, refusal reason)
        self._counters: dict[tuple[str, int], CounterChild] = {}
        self._histograms: dict[str, HistogramChild] = {}

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
            try:
                message = await receive()
            except asyncio.CancelledError:
                # A forced stop (a second Ctrl-C) skips the shutdown message: still stop what
                # start-up started (launched backends), and end quietly rather than with a traceback.
                if self._shutdown is not None:
                    log.warning("forced to stop: stopping launched backends now")
                    await self._shutdown()
                return
            if message["type"] == "lifespan.startup":
                try:
                    if self._startup is not None:
                        await self._startup()
                except Exception as exc:
                    log.error("start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    if self._shutdown is not None:
                        await self._shutdown()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    # -- one request ------------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        origin = None
        if self.cors is not None:
            origin = _header(scope, b"origin")
            if scope["method"] == "OPTIONS" and await self._preflight(scope, origin, send):
                return
        ctx = self._context(scope)
        if isinstance(ctx, Refusal):
            rid = _new_request_id()
            await refuse(_Answer(send, self._answer_headers(rid, "openai", origin)), ctx, "openai")
            status, kind, reason = ctx.status, "unrouted", ctx.reason
            ctx = None
        else:
            given = ctx.headers.get(b"x-request-id")
            rid = ctx.request_id = given.decode() if given is not None and _REQUEST_ID.match(given) else _new_request_id()
            if self.tracer is not None:
                ctx.span = self.tracer.start(scope["method"], ctx.route.path, ctx.headers)
            status = await self._run(ctx, receive, _Answer(send, self._answer_headers(ctx.request_id, ctx.style, origin)))
            kind, reason = ctx.route.kind, ctx.refusal
            tracing.finish(ctx, status)
        elapsed = time.monotonic() - started
        counter = self._counters.get((kind, status // 100))
        if counter is None:  # labels() validates: look each child up once
            counter = self._counters[(kind, status // 100)] = metrics.REQUESTS.labels(route=kind, status=_STATUS_CLASS.get(status // 100, "other"))
        counter.inc()
        if kind != "unrouted":
            histogram = self._histograms.get(kind)
            if histogram is None:
                histogram = self._histograms[kind] = metrics.LATENCY.labels(route=kind)
            histogram.observe(elapsed)
        if self.observe is not None:
            self.observe(ctx, status, elapsed, reason)
        if self.access_log:
            self._log_access(scope, ctx, status, elapsed, rid, reason)

    def _answer_headers(self, rid: str, style: str, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        extra = [(b"x-request-id", rid.encode())]
        if style == "anthropic":
            extra.append((b"request-id", rid.encode()))  # what Anthropic's SDKs read
        if self.cors is not None:
            extra += self.cors.response_headers(origin)
        return extra

    async def _preflight(self, scope: Scope, origin: bytes | None, send: Send) -> bool:
        assert self.cors is not None
        headers = self.cors.preflight(scope["path"], origin, _header(scope, b"access-control-request-method"))
        if headers is None:
            return False
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    def _log_access(self, scope: Scope, ctx: RequestContext | None, status: int, elapsed: float, rid: str, refusal: str | None) -> None:
        key = ctx.key if ctx is not None else None
        outcome = ctx.outcome if ctx is not None else None
        # Keys are named by their configured name and a short id of their hash, never by value.
        fields = logs.access_fields(
            request_id=rid,
            method=scope["method"],
            path=_printable(scope["path"]),
            route=ctx.route.kind if ctx is not None else "unrouted",
            status=status,
            duration=elapsed,
            client=_client(scope),
            key=f"{key.name}/{key_id(key.hash)}" if key else None,
            model=_printable(ctx.model) if ctx is not None and ctx.model else None,
            backend=ctx.backend if ctx is not None else None,
            ttfb=outcome.ttft if outcome is not None else None,
            prompt_tokens=outcome.prompt_tokens if outcome is not None else None,
            completion_tokens=outcome.completion_tokens if outcome is not None else None,
            refusal=refusal,
        )
        logs.access_log.info(
            '%s "%s %s" %d %.1fms key=%s model=%s', fields["client"], fields["method"], fields["path"], status, elapsed * 1000,
            fields["key"] or "-", fields["model"] or "-", extra={"fields": fields},
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

    async def _run(self, ctx: RequestContext, receive: Receive, send: "_Answer") -> int:
        """The chain for one routed request; returns the status the client got (499: it left)."""
        route = ctx.route
        refusal = _check(ctx, "filter.auth", self.auth.check)
        if refusal is None and route.forward and ctx.key is not None:
            refusal = RouteAccess.key_refusal(route, ctx.key.routes)  # before any body byte: default-deny per key
        if refusal is None and not route.forward:
            return await self.local.answer(ctx, send)
        if refusal is None:
            refusal = self.body.check_headers(ctx)
        if refusal is not None:
            # The body was never read: the connection ends after the answer (the server drains what
            # the client still sends, bounded, so a client that writes its body first reads this).
            return await self._refuse(ctx, send, refusal, close=_has_body(ctx))
        grant = self.uploads.grant(ctx)
        if grant is None:
            return await self._refuse(ctx, send, UPLOAD_BUSY, close=True)
        try:
            return await self._run_body(ctx, grant, receive, send)
        finally:
            grant.release()  # the body is held until the request is over

    async def _run_body(self, ctx: RequestContext, grant: UploadGrant, receive: Receive, send: "_Answer") -> int:
        try:
            raw = await self._read_body(receive, grant)
        except _ClientGone:
            return 499
        if isinstance(raw, Refusal):
            return await self._refuse(ctx, send, raw, close=True)
        refusal = _check(ctx, "filter.body", lambda ctx: self.body.parse(ctx, raw))
        if refusal is None and not model_allowed(ctx.key, ctx.model or ""):
            refusal = model_not_found(ctx.model or "")
        if refusal is None:
            with tracing.child(ctx, "filter.media"):
                refusal = await self.media.check_body_async(ctx) if self.media.is_async else self.media.check_body(ctx)
        if refusal is not None:
            return await self._refuse(ctx, send, refusal)
        payload = self.body.serialise(ctx.body)  # type: ignore[arg-type]
        if isinstance(payload, Refusal):
            return await self._refuse(ctx, send, payload)
        with tracing.child(ctx, "filter.limits"):
            admission = await self.limits.admit(ctx)  # per-key limits (state layer): one store call at most
        if isinstance(admission, Refusal):
            return await self._refuse(ctx, send, admission)
        ctx.admission = admission
        try:
            return await self._forward(ctx, payload, receive, send)
        finally:
            if admission is not None:
                self.limits.settle(admission, ctx.outcome)

    async def _refuse(self, ctx: RequestContext, send: Send, refusal: Refusal, close: bool = False) -> int:
        ctx.refusal = refusal.reason
        return await refuse(send, refusal, ctx.style, close=close)

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

    async def _forward(self, ctx: RequestContext, payload: bytes, receive: Receive, send: "_Answer") -> int:
        headers = [_JSON, (b"x-request-id", ctx.request_id.encode())]
        for name in FORWARD_REQUEST_HEADERS:
            value = ctx.headers.get(name)
            if value is not None and b"\x00" not in value:
                headers.append((name, value))

        if ctx.admission is not None and ctx.admission.headers:
            send.extra = [*ctx.admission.headers, *send.extra]  # the limits' headers, on every answer from here on
        gone = _Gone(send)
        on_disconnect = ctx.scope.get("extensions", _NO_EXTENSIONS).get(DISCONNECT_EXTENSION)

        async def reply(refusal: Refusal) -> None:
            await self._refuse(ctx, send, refusal)

        # A client that goes away must cancel the upstream request: that frees the GPU. Our server
        # says so itself (DISCONNECT_EXTENSION: no task, no timer per request); on another server,
        # a task watches receive() for it.
        timer = None
        watcher: list[asyncio.Task[None]] = []
        try:
            if on_disconnect is not None:
                on_disconnect(gone)
            else:
                # The loop is passed on: each get_running_loop() is a getpid() syscall on Python < 3.12.
                loop = asyncio.get_running_loop()
                task = asyncio.current_task(loop)

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            gone(task)
                            return

                # Watching costs a task; a request that is over within WATCH_AFTER never needs it, so
                # the watcher starts only then (a timer handle is far cheaper than a task).
                timer = loop.call_later(WATCH_AFTER, lambda: watcher.append(loop.create_task(watch())))
            return await self.router.forward(ctx, payload, headers, send, reply)
        except asyncio.CancelledError:
            if gone.task is None:
                raise
            if hasattr(gone.task, "uncancel"):
                gone.task.uncancel()  # type: ignore[union-attr]
            metrics.CLIENT_DISCONNECTS.inc()
            log.info("client went away; upstream request cancelled (key %s)", key_id(ctx.key.hash) if ctx.key else "-")
            return 499
        finally:
            if on_disconnect is not None:
                on_disconnect(None)
            if timer is not None:
                timer.cancel()
            if watcher:
                watcher[0].cancel()


class _Gone:
    """Called with the request's task when its client went away: cancels it unless the answer was
    complete (a disconnect after it is no reason to cancel anything). ``task``: the task cancelled."""

    __slots__ = ("send", "task")

    def __init__(self, send: "_Answer"):
        self.send = send
        self.task: asyncio.Task[Any] | None = None

    def __call__(self, task: asyncio.Task[Any] | None) -> None:
        if not self.send.done and task is not None and self.task is None:
            self.task = task
            task.cancel()


def _check(ctx: RequestContext, name: str, check: Callable[[RequestContext], Refusal | None]) -> Refusal | None:
    """Run one filter, in its own span when the request is traced."""
    if ctx.span is None:
        return check(ctx)
    with ctx.span.child(name):
        return check(ctx)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class _Answer:
    """``send`` with ``extra`` headers on the response start (request id, CORS, the limits'): every
    answer gets them. ``done``: the response's last message went (a disconnect after it is no
    reason to cancel anything). One object and one call per message, not a wrapper per concern."""

    __slots__ = ("send", "extra", "done")

    def __init__(self, send: Send, extra: list[tuple[bytes, bytes]]):
        self.send = send
        self.extra = extra
        self.done = False

    def __call__(self, message: dict[str, Any]) -> Awaitable[None]:
        # Not a coroutine itself: it hands back the server's send, one coroutine per message, not two.
        if message["type"] == "http.response.start":
            message["headers"] = [*message["headers"], *self.extra]
        elif not message.get("more_body", False):
            self.done = True
        return self.send(message)
