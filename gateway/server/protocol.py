"""One HTTP/1.1 connection: bounded parsing, timeouts, and the ASGI cycle of each request.

Why our own: the gateway must bound the work a client can cause before it is authenticated.
httptools joins a header that arrives in many reads by concatenation (quadratic) and has no size
or count limit, and no ASGI server we measured had a header timeout, a connection cap below the
file limit, or refused Upgrade. Here:

- the head (request line + headers) is buffered by us until its blank line, up to
  ``max_head`` bytes, then parsed in one piece: linear, and a 64 MB header is cut off at the
  limit (431; 414 for a request line with no end in sight), never parsed;
- header lines are counted while parsed (431 past ``max_headers``, parsing stops there);
- timers: ``keepalive`` while no request is in progress, ``header`` from a request's first byte
  to its blank line, ``body`` from there to the body's end (408 for the last two);
- an upgrade (``Upgrade`` with ``Connection: upgrade``: h2c, websocket) and CONNECT are refused
  (400); an ``Upgrade`` header alone is ignored and the body framed by its length. A connection
  carries HTTP/1.1 requests only, so bytes after a request never become a second, unchecked one;
- an answer given before the request's body was read ends the connection with a lingering
  close: our side is shut for writing after the answer, the client's data is drained (bounded
  in time and bytes), then the socket is closed, so a client that writes its whole body before
  reading gets our status and not a reset.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable

import httptools

from .._compat import nodelay
from ..deadline import MovingDeadline
from .answers import STATUS_PHRASES, error_response

if TYPE_CHECKING:
    from .connections import Connections

log = logging.getLogger("gateway.server")

# The scope extension by which an app learns of its client going away without awaiting receive():
# ``scope["extensions"][DISCONNECT_EXTENSION](fn)`` has ``fn(task)`` called once, with the task that
# runs the app, when the connection is lost (at once if it already was); ``(None)`` withdraws it.
# A per-request watcher task or timer is what it saves (see the listener's ``_forward``).
DISCONNECT_EXTENSION = "gateway.on_disconnect"

BODY_HIGH_WATER = 256 * 1024  # body bytes buffered for the app before we stop reading the socket
HEAD_ERROR_LINGER = 1 << 20  # bytes drained after refusing a head: it was not a body we promised to read
# Header names that need a look, lower-case: one set lookup per header line sends the rest on at once.
_REQUEST_SPECIAL = frozenset((b"upgrade", b"connection", b"expect"))
_RESPONSE_SPECIAL = frozenset((b"content-length", b"connection", b"transfer-encoding"))


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing: the head broke a rule."""

    def __init__(self, status: int, message: str, code: str):
        self.status, self.message, self.code = status, message, code


class HttpConnection(asyncio.Protocol):
    def __init__(self, connections: "Connections"):
        self.conns = connections
        self.limits = connections.limits
        self.app = connections.app
        self.loop = connections.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None
        # head phase
        self.in_head = True
        self.head = bytearray()
        self.fed_tail = b""  # last bytes fed to the parser: a blank line may straddle two reads
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.upgrade = False
        self.connection_upgrade = False
        self.expect_continue = False
        # requests
        self.cycle: RequestCycle | None = None  # the one the app is running
        self.pending: collections.deque[RequestCycle] = collections.deque()  # pipelined, parsed ahead
        self.parsing: RequestCycle | None = None  # the one whose body is being parsed
        # One deadline at a time (keep-alive, header, body, linger), on one moving timer.
        self.clock = MovingDeadline(self.loop)
        self.lingering = False
        self.linger_left = 0
        self.closed = False
        self.closing_after_response = False  # draining for shutdown
        self.write_paused = False
        self.drain_waiters: list[asyncio.Future[None]] = []
        self.reading_paused = False
        self.out: list[bytes] = []  # response bytes queued in this loop iteration (see ``write``)

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)  # each SSE chunk leaves as written, not after the previous one's ACK
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.server = (sock[0], sock[1]) if isinstance(sock, tuple) else None
        if not self.conns.admit(self):
            return
        self._arm(self.limits.keepalive_timeout, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.out.clear()
        self.clock.stop()  # nothing is left to time: do not keep this connection alive until it fires
        self.conns.forget(self)
        for cycle in (self.cycle, self.parsing, *self.pending):
            if cycle is not None:
                cycle.disconnect()
        for w in self.drain_waiters:
            if not w.done():
                w.set_result(None)
        self.drain_waiters.clear()

    def eof_received(self) -> bool | None:
        # The client is done sending: as for uvicorn, that ends the connection, and a running
        # request sees its client go (which cancels its upstream request).
        self._disarm()
        return None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for w in self.drain_waiters:
            if not w.done():
                w.set_result(None)
        self.drain_waiters.clear()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.linger_left -= len(data)
            if self.linger_left < 0:
                self._close()
            return
        if self.closed:
            return
        if self.in_head:
            self._head_data(data)
        else:
            self._feed(data)

    # -- parsing ------------------------------------------------------------------------------
    def _head_data(self, data: bytes) -> None:
        limits = self.limits
        start = len(self.head)
        if start == 0:
            if self.cycle is None and not self.pending:
                # A request's first byte: the keep-alive wait becomes the header deadline.
                self.conns.busy(self)
                self._arm(limits.header_timeout, self._header_expired)
            end = data.find(b"\r\n\r\n")
            if 0 <= end <= limits.max_head - 4 and (end < limits.max_request_line or b"\n" in data[: limits.max_request_line + 1]):
                self._feed(data)  # the usual case: a whole head in one read, parsed without a copy
                return
        self.head += data
        scan = max(0, start - 3)
        end = self.head.find(b"\r\n\r\n", scan)
        if end < 0 and self.fed_tail:
            end = (self.fed_tail + bytes(self.head[:3])).find(b"\r\n\r\n")  # straddles the parser's last bytes
            end = 0 if end >= 0 else -1
        if end < 0:
            if len(self.head) > limits.max_request_line and b"\n" not in self.head[: limits.max_request_line + 1]:
                self._refuse_head(414, f"Request line is longer than the limit of {limits.max_request_line} bytes.", "request_line_too_long")
            elif len(self.head) > limits.max_head:
                self._refuse_head(431, f"Request headers are larger than the limit of {limits.max_head} bytes.", "headers_too_large")
            return
        if end + 4 > limits.max_head:
            self._refuse_head(431, f"Request headers are larger than the limit of {limits.max_head} bytes.", "headers_too_large")
            return
        chunk = bytes(self.head)
        self.head = bytearray()
        self._feed(chunk)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse_head(refused.status, refused.message, refused.code)
            else:
                log.exception("request parser callback failed")
                self._refuse_head(400, "Malformed request.", "bad_request")
            return
        except httptools.HttpParserInvalidURLError:
            self._refuse_head(400, "The request target is not a valid path.", "invalid_path")
            return
        except httptools.HttpParserUpgrade:
            self._refuse_head(400, "Protocol upgrades are not supported.", "upgrade_not_supported")
            return
        except httptools.HttpParserError:
            self._refuse_head(400, "Malformed HTTP request.", "bad_request")
            return
        self.fed_tail = data[-3:]

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.in_head = True
        self.url = b""
        self.headers = []
        self.upgrade = False
        self.connection_upgrade = False
        self.expect_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url  # one piece: the head is fed whole
        if len(self.url) > self.limits.max_request_line:
            raise _Refused(414, f"Request line is longer than the limit of {self.limits.max_request_line} bytes.", "request_line_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            raise _Refused(431, f"Request has more than {self.limits.max_headers} header lines.", "too_many_headers")
        name = name.lower()
        if name in _REQUEST_SPECIAL:
            if name == b"upgrade":
                self.upgrade = True
            elif name == b"connection":
                if b"upgrade" in value.lower():
                    self.connection_upgrade = True
            elif value.lower() == b"100-continue":
                self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        method = parser.get_method()
        if (self.upgrade and self.connection_upgrade) or method == b"CONNECT":
            # What the parser would hand over as another protocol. An Upgrade header without
            # "Connection: upgrade" is not one: it is ignored, and the body framed by its length.
            raise _Refused(400, "Protocol upgrades are not supported.", "upgrade_not_supported")
        try:
            parsed = httptools.parse_url(self.url)
            raw_path = parsed.path
            path = raw_path.decode("latin-1")  # non-ASCII bytes reach the path policy, which refuses them
        except httptools.HttpParserInvalidURLError:
            raise _Refused(400, "The request target is not a valid path.", "invalid_path") from None
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": parser.get_http_version(),
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": method.decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": self.headers,
        }
        cycle = RequestCycle(self, scope, parser.should_keep_alive(), self.expect_continue)
        scope["extensions"] = {DISCONNECT_EXTENSION: cycle.on_disconnect}
        self.in_head = False
        self.parsing = cycle
        if self.cycle is None:
            self._start(cycle)
        else:  # pipelined: parsed ahead, run after the current one; stop reading meanwhile
            self.pending.append(cycle)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None:
            return
        cycle.body.append(body)
        cycle.buffered += len(body)
        if cycle.buffered > BODY_HIGH_WATER:
            self._pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.parsing
        self.parsing = None
        self.in_head = True
        if cycle is None:
            return
        cycle.more_body = False
        cycle.wake()
        if cycle is self.cycle:
            self._disarm()  # body timer; the keep-alive one starts when the response is done

    # -- request lifecycle ----------------------------------------------------------------------
    def _start(self, cycle: "RequestCycle") -> None:
        self.cycle = cycle
        self.conns.busy(self)
        if cycle.more_body:
            self._arm(self.limits.body_timeout, self._body_expired)
        else:
            self._disarm()
        cycle.task = self.loop.create_task(cycle.run(self.app))

    def response_done(self, cycle: "RequestCycle") -> None:
        """The app finished its response: keep the connection for the next request, or end it."""
        if cycle is not self.cycle or self.closed:
            return
        self.cycle = None
        if cycle.more_body:
            # The app answered without reading the whole body: never parse what follows.
            self.linger(self.limits.linger_bytes)
            return
        if not cycle.keep_alive or self.closing_after_response:
            self._close()
            return
        if self.pending:
            self._start(self.pending.popleft())
            self._resume_reading()
            return
        self.conns.idle(self)
        self._resume_reading()
        if self.head:
            self._arm(self.limits.header_timeout, self._header_expired)
        else:
            self._arm(self.limits.keepalive_timeout, self._idle_expired)

    def _refuse_head(self, status: int, message: str, code: str) -> None:
        """Answer a request the app never saw, then end the connection."""
        if self.closed or self.lingering:
            return
        self.head = bytearray()
        if self.cycle is not None:
            # A pipelined request broke a rule while another runs: end it all once that is done.
            self.cycle.keep_alive = False
            self._pause_reading()
            return
        self.transport.write(error_response(status, message, code))  # type: ignore[union-attr]
        self.linger(min(self.limits.linger_bytes, HEAD_ERROR_LINGER))

    def linger(self, budget: int) -> None:
        """Shut our side after what is written, drain the client's data for a bounded time, close."""
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            return
        self.lingering = True
        self.linger_left = budget
        self.conns.busy(self)
        self._resume_reading()
        self.flush()
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self._close()
            return
        self._arm(self.limits.linger_timeout, self._close)

    # -- timers -------------------------------------------------------------------------------
    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        """``callback`` in ``delay`` seconds, replacing what was armed (a request moves the deadline
        three times: header, body, keep-alive)."""
        self.clock.arm(self.loop.time() + delay, callback)

    def _disarm(self) -> None:
        self.clock.disarm()

    def _idle_expired(self) -> None:
        self._close()

    def _header_expired(self) -> None:
        self._refuse_head(408, f"Request headers were not received within {self.limits.header_timeout:g} s.", "header_timeout")

    def _body_expired(self) -> None:
        cycle = self.cycle
        if cycle is None or self.closed:
            return
        if not cycle.response_started:
            cycle.response_started = cycle.response_complete = True
            self.transport.write(error_response(408, f"Request body was not received within {self.limits.body_timeout:g} s.", "body_timeout"))  # type: ignore[union-attr]
        cycle.disconnect()
        self._close()

    # -- helpers ------------------------------------------------------------------------------
    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def _close(self) -> None:
        self._disarm()
        self.flush()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- response bytes ---------------------------------------------------------------------------
    def write(self, data: bytes, last: bool) -> None:
        """Response bytes. A response's last piece goes out at once, with whatever is queued; other
        pieces are queued until then or the end of this loop iteration, so a stream's head, chunks
        and terminator handed over together leave in one write (one syscall, one wake-up of the
        client) instead of one each, and a chunk that arrives alone still leaves without delay."""
        out = self.out
        if last:
            if out:
                out.append(data)
                self.flush()
            else:
                self.transport.write(data)  # type: ignore[union-attr]
            return
        if not out:
            self.loop.call_soon(self.flush)
        out.append(data)

    def flush(self) -> None:
        out = self.out
        if not out:
            return
        self.out = []
        transport = self.transport
        if transport is not None and not self.closed and not transport.is_closing():
            if len(out) == 1:
                transport.write(out[0])
            else:
                transport.writelines(out)  # one writev, no copy of a large body

    def shutdown(self) -> None:
        """Server drain: close now if no request is in progress, else after its response."""
        self.closing_after_response = True
        if self.cycle is None and not self.pending and not self.lingering:
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def drain(self) -> None:
        if self.write_paused and not self.closed:
            waiter = self.loop.create_future()
            self.drain_waiters.append(waiter)
            await waiter


class RequestCycle:
    """One request as the app sees it: ``receive`` hands out body chunks, ``send`` writes the answer."""

    __slots__ = (
        "conn", "scope", "keep_alive", "expect_continue", "body", "buffered", "more_body", "disconnected",
        "waiter", "response_started", "response_complete", "chunked", "task", "head_only", "started_at", "body_handed", "held_head",
        "on_gone",
    )

    def __init__(self, conn: HttpConnection, scope: dict[str, Any], keep_alive: bool, expect_continue: bool):
        self.conn = conn
        self.scope: dict[str, Any] | None = scope  # until run() takes it
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []
        self.buffered = 0
        self.more_body = True
        self.body_handed = False
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.held_head = b""
        self.task: asyncio.Task[None] | None = None
        self.on_gone: Callable[[asyncio.Task[None] | None], None] | None = None  # see DISCONNECT_EXTENSION
        self.head_only = scope["method"] == "HEAD"
        self.started_at = time.monotonic()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake()
        fn = self.on_gone
        if fn is not None:
            self.on_gone = None
            fn(self.task)

    def on_disconnect(self, fn: Callable[[asyncio.Task[None] | None], None] | None) -> None:
        """The DISCONNECT_EXTENSION: ``fn(task)`` once the client is gone (now, if it is); None withdraws it."""
        if fn is not None and self.disconnected:
            fn(self.task)
            return
        self.on_gone = fn

    async def run(self, app: Any) -> None:
        # The scope is held by this frame only, and the hook dropped at the end: the scope's
        # DISCONNECT_EXTENSION refers back to this cycle, and a reference cycle per request would
        # be left to the collector (its young collections then find a request's objects each time).
        scope, self.scope = self.scope, None
        try:
            await app(scope, self.receive, self.send)
        except Exception:
            log.exception("request handler failed")
            if not self.response_started and not self.disconnected:
                self.response_started = True
                self.conn.transport.write(error_response(500, "Internal server error.", "internal_error"))  # type: ignore[union-attr]
                self.response_complete = True
                self.conn._close()
                return
        finally:
            self.on_gone = None
        if not self.response_complete and not self.disconnected:
            if self.response_started:  # a response the app did not finish cannot be framed: end it
                self.conn._close()
            else:
                self.conn.transport.write(error_response(500, "Internal server error.", "internal_error"))  # type: ignore[union-attr]
                self.conn._close()
            return
        self.conn.response_done(self)

    async def _wait(self) -> None:
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.expect_continue and not self.response_started and not self.disconnected:
            self.expect_continue = False
            conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        while not self.body and self.more_body and not self.disconnected and not self.response_complete:
            conn._resume_reading()
            await self._wait()
        if not self.body_handed and not self.disconnected and (self.body or not self.more_body):
            data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            self.body.clear()
            self.buffered = 0
            if self.more_body:
                conn._resume_reading()
            else:
                self.body_handed = True
            return {"type": "http.request", "body": data, "more_body": self.more_body}
        # The whole body was handed over: what is left to say is that the client went away.
        while not self.disconnected and not self.response_complete:
            await self._wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if self.disconnected or conn.closed or conn.transport.is_closing():  # type: ignore[union-attr]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.response_complete = True
            return
        kind = message["type"]
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("response already started")
            self.response_started = True
            self.expect_continue = False
            status = message["status"]
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, STATUS_PHRASES.get(status, b""))]
            has_length = False
            close = not self.keep_alive or conn.closing_after_response or self.more_body
            for name, value in message.get("headers", ()):
                lname = name.lower()
                if lname in _RESPONSE_SPECIAL:
                    if lname == b"content-length":
                        has_length = True
                    else:
                        if lname == b"connection" and value.lower() == b"close":
                            close = True
                        continue  # connection and transfer-encoding: the framing is ours
                lines.append(b"%s: %s\r\n" % (name, value))
            if not has_length and not self.head_only and status not in (204, 304) and status >= 200:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            if close:
                self.keep_alive = False
                lines.append(b"connection: close\r\n")
            lines.append(b"\r\n")
            if has_length:
                # A sized body follows at once: head and body leave in one write (one syscall less).
                self.held_head = b"".join(lines)
            else:
                conn.write(b"".join(lines), False)  # a stream: the head goes now (this loop iteration)
        elif kind == "http.response.body":
            if not self.response_started or self.response_complete:
                raise RuntimeError("response body outside a response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if self.held_head:
                head, self.held_head = self.held_head, b""
                if body and not self.head_only and len(body) <= 65536:
                    body = head + body
                else:
                    conn.write(head, not more and (self.head_only or not body))
            if self.head_only:
                pass
            elif self.chunked:
                # The last chunk and the terminator go together.
                if body:
                    conn.write(b"".join((b"%x\r\n" % len(body), body, b"\r\n0\r\n\r\n" if not more else b"\r\n")), not more)
                elif not more:
                    conn.write(b"0\r\n\r\n", True)
            elif body:
                conn.write(body, not more)
            if not more:
                conn.flush()  # a last message with nothing to write (HEAD, an empty body) still ends what is queued
                self.response_complete = True
                self.wake()
            elif conn.write_paused:
                await conn.drain()
