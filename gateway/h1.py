"""A minimal pooled HTTP/1.1 client for the hot path: asyncio protocol + httptools parser.

Why not a general client: the gateway sends one kind of request (a POST with a JSON body to a
URL it built itself) and relays the answer. A general client spends most of its time on what we
do not need (URL parsing, header objects, cookies, redirects, auto headers); under load that was
the largest single cost in the gateway (bench/overhead.py shows all transports side by side).

What it does: keep-alive connections per backend (idle ones expire before the backend's own
keep-alive timeout), one write per request, the response parsed by httptools (chunked or
sized), body chunks handed over as they arrive with back-pressure (reading pauses while the
consumer is behind), and a connection that is given up mid-response is closed, so the backend
sees its client leave and stops generating.

Backends are untrusted, so the parse is bounded and strict: the response head has a byte and a
header-count limit (counted as bytes arrive, before the parser accumulates them); only a final
status (200-599) is a response (an interim ``100 Continue`` is skipped; any other 1xx and ``101``
are refused); and bytes after a complete response (a second, unsolicited response, or garbage)
poison the connection: it is closed, never reused, and those bytes reach nobody.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import logging
import time
from typing import AsyncIterator

import httptools

from ._compat import nodelay
from ._compat import timeout as _timeout
from .deadline import MovingDeadline

IDLE_EXPIRY = 4.0  # below uvicorn's (and so lmdeploy's) 5 s keep-alive timeout
HIGH_WATER = 1 << 20  # bytes buffered for a slow consumer before we stop reading from the backend
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100

log = logging.getLogger("gateway.upstream")


class ConnectFailed(Exception):
    """No connection could be made (refused, unreachable): nothing was sent."""


class ConnectTimeout(Exception):
    """The connection was not established within the connect timeout."""


class ConnectionLost(Exception):
    """The connection closed before the response was complete."""


class InvalidResponse(Exception):
    """The backend broke the protocol or a limit; ``reason`` says how (a metric label)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Timeout(Exception):
    """A deadline passed while waiting for the backend: the response head, or a body chunk."""


# A waiter's result when its deadline passed. A timer handle that resolves the waiter is far
# cheaper than a timeout context (which cancels the task and uncancels it again), and none is
# waited on at all when the bytes are already there, the usual case for a small response.
_TIMED_OUT = object()


class _Violation(Exception):
    """Raised inside a parser callback to stop the parse; the reason is kept on the connection."""


class _Conn(asyncio.Protocol):
    __slots__ = (
        "transport", "parser", "status", "headers", "chunks", "buffered", "done", "lost",
        "waiter", "head_waiter", "keep_alive", "idle_since", "_paused", "_header_name",
        "violation", "head_bytes", "head_complete", "max_header_bytes", "max_headers", "peer", "why", "header_size", "loop",
        "clock", "timed",
    )

    def __init__(self, max_header_bytes: int = MAX_HEADER_BYTES, max_headers: int = MAX_HEADERS, peer: str = "") -> None:
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lost = False
        self.idle_since = 0.0
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.peer = peer  # host:port, for the operator's log only
        self.violation: str | None = None
        self.why: str | None = None  # set by a parser callback that refused what it saw
        self.parser = httptools.HttpResponseParser(self)
        # One deadline at a time (the head's, then each body wait's): ``timed`` is resolved with
        # _TIMED_OUT when ``clock`` (made with the connection) expires, as the server's connections time theirs.
        self.clock: MovingDeadline | None = None
        self.timed: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        """State for the next response. The parser is kept: a connection is reused only after a
        complete keep-alive response, after which llhttp starts the next message afresh (one
        parser per connection, not one per request)."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.done = False
        self.keep_alive = False
        self.waiter: asyncio.Future[None] | None = None
        self.head_waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._header_name = b""
        self.head_bytes = 0  # raw bytes received while the head is incomplete
        self.header_size = 0  # parsed header bytes: a whole head may arrive in one read
        self.head_complete = False

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Kept here: asyncio.get_running_loop() costs a getpid() syscall per call on Python < 3.12.
        self.loop = asyncio.get_running_loop()
        self.clock = MovingDeadline(self.loop)
        nodelay(transport)  # the request goes out in one write; its bytes must not wait for an ACK

    def data_received(self, data: bytes) -> None:
        if self.done or self.violation is not None:
            # Nothing was asked for (an idle connection, or a response already complete).
            self._poison(self.violation or "trailing_bytes")
            return
        if not self.head_complete:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._poison(self.why or ("trailing_bytes" if self.done else "malformed"))
            return
        if not self.head_complete and self.head_bytes > self.max_header_bytes:
            self._poison("headers_too_large")

    def _poison(self, reason: str) -> None:
        """Stop reading, close, never reuse. A response already complete is still delivered."""
        if self.violation is None:
            self.violation = reason
            log.warning("backend %s broke the protocol (%s); connection closed", self.peer, reason)
        self.keep_alive = False
        self._fail()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail()
        self.timed = None
        if self.clock is not None:  # nothing is left to time: do not keep this connection alive until it fires
            self.clock.stop()

    # -- deadlines --------------------------------------------------------------------------------
    def time(self, waiter: asyncio.Future, deadline: float) -> None:
        """Resolve ``waiter`` with _TIMED_OUT at ``deadline`` (loop time) unless it is done first; the
        caller calls ``untime`` after its wait."""
        self.timed = waiter
        self.clock.arm(deadline, self._timed_out)  # type: ignore[union-attr]  # made in connection_made

    def untime(self) -> None:
        self.timed = None
        if self.clock is not None:
            self.clock.disarm()

    def _timed_out(self) -> None:
        waiter, self.timed = self.timed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(_TIMED_OUT)

    def _fail(self) -> None:
        self.lost = True
        for fut in (self.head_waiter, self.waiter):
            if fut is not None and not fut.done():
                fut.set_result(None)

    # -- httptools callbacks ------------------------------------------------------------------------
    def _violate(self, reason: str) -> None:
        self.why = reason
        raise _Violation(reason)

    def on_message_begin(self) -> None:
        if self.done:  # a second response to one request
            self._violate("trailing_bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.max_headers:
            self._violate("too_many_headers")
        self.header_size += len(name) + len(value) + 4
        if self.header_size > self.max_header_bytes:
            self._violate("headers_too_large")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 100:  # interim: the final response follows on the same connection
            self.headers = []
            self.header_size = 0
            return
        if not 200 <= status <= 599:
            self._violate(f"status_{status}" if 100 <= status <= 199 else "bad_status")
        self.status = status
        self.head_complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.head_waiter is not None and not self.head_waiter.done():
            self.head_waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_complete:  # the end of an interim 100: its head does not count
            self.head_bytes = 0
            return
        self.done = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # -- used by the client ----------------------------------------------------------------------------
    def take(self) -> bytes | None:
        """Buffered body bytes, or None when there are none right now."""
        if not self.chunks:
            return None
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data


class H1Response:
    __slots__ = ("status", "headers", "_conn", "_pool", "_closed")

    def __init__(self, conn: _Conn, pool: "H1Pool"):
        self.status = conn.status
        self.headers = conn.headers
        self._conn = conn
        self._pool = pool
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            data = await self.next_chunk()
            if data is None:
                return
            yield data

    def whole(self) -> bytes | None:
        """The whole body when all of it is already here (the usual case for a small response),
        else None and nothing is taken."""
        conn = self._conn
        if not conn.done or conn.violation is not None:
            return None
        data = conn.take()
        return b"" if data is None else data

    def spoil(self) -> None:
        """Never reuse this connection (aclose closes it)."""
        self._conn.keep_alive = False

    def buffered(self) -> bytes | None:
        """Body bytes already received, without waiting (None when there are none right now)."""
        return self._conn.take()

    async def next_chunk(self, timeout: float | None = None) -> bytes | None:
        """The body bytes buffered so far, waiting up to ``timeout`` seconds for some if there are
        none; None at the end of the body. Raises Timeout, InvalidResponse or ConnectionLost."""
        conn = self._conn
        while True:
            data = conn.take()
            if data is not None:
                return data
            if conn.done:
                return None
            if conn.violation is not None:
                raise InvalidResponse(conn.violation)
            if conn.lost:
                raise ConnectionLost()
            loop = conn.loop or asyncio.get_running_loop()
            waiter = conn.waiter = loop.create_future()
            if timeout is not None:
                conn.time(waiter, loop.time() + timeout)
            try:
                await waiter
            finally:
                conn.waiter = None
                conn.untime()
            if waiter.result() is _TIMED_OUT:
                raise Timeout()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.done and not conn.chunks and conn.keep_alive and not conn.lost and conn.violation is None:
            self._pool.release(conn)
        elif conn.transport is not None:
            conn.transport.close()  # mid-response: the backend must see us leave


class H1Pool:
    """Keep-alive connections to one backend (host, port)."""

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout: float,
        tls: ssl.SSLContext | None = None,
        *,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_headers: int = MAX_HEADERS,
    ):
        self.host = host
        self.port = port
        self.tls = tls
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.idle: collections.deque[_Conn] = collections.deque()
        self.connect_timeout = connect_timeout

    def _reuse(self) -> _Conn | None:
        """An idle connection that is still good, or None."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # most recently used first: it is the least likely to be closing
            if not conn.lost and conn.violation is None and now - conn.idle_since < IDLE_EXPIRY:
                conn._reset()
                return conn
            if conn.transport is not None:
                conn.transport.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()

        def make() -> _Conn:
            return _Conn(self.max_header_bytes, self.max_headers, f"{self.host}:{self.port}")

        try:
            async with _timeout(self.connect_timeout):
                if self.tls is None:
                    _, conn = await loop.create_connection(make, self.host, self.port)
                else:
                    _, conn = await loop.create_connection(make, self.host, self.port, ssl=self.tls, server_hostname=self.host)
        except TimeoutError:
            raise ConnectTimeout() from None
        except OSError as exc:
            raise ConnectFailed(str(exc)) from None
        return conn

    def release(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    async def request(self, head: bytes, body: bytes, first_byte: float | None = None) -> H1Response:
        """Send one request; return when the response head has arrived. ``first_byte``: seconds for
        all of it, a new connection included (Timeout past them)."""
        conn = self._reuse()
        loop = conn.loop if conn is not None and conn.loop is not None else asyncio.get_running_loop()
        deadline = loop.time() + first_byte if first_byte is not None else None
        if conn is None:
            if first_byte is None:
                conn = await self._connect()
            else:
                try:
                    async with _timeout(first_byte):
                        conn = await self._connect()
                except TimeoutError:
                    raise Timeout() from None
        waiter = conn.head_waiter = loop.create_future()
        assert conn.transport is not None
        conn.transport.writelines((head, body))
        if deadline is not None:
            conn.time(waiter, deadline)
        try:
            await waiter
        except BaseException:
            conn.transport.close()
            raise
        finally:
            conn.head_waiter = None
            conn.untime()
        if waiter.result() is _TIMED_OUT:
            conn.transport.close()  # the backend may still answer: that connection is done
            raise Timeout()
        if conn.status == 0:  # lost (or refused) before a final status line
            conn.transport.close()
            if conn.violation is not None:
                raise InvalidResponse(conn.violation)
            raise ConnectionLost()
        return H1Response(conn, self)

    def close(self) -> None:
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None:
                conn.transport.close()
