"""A lean pipelined RESP connection for the hot path's script calls (admission and settle).

redis-py costs more per batch than the scripts themselves: a pool acquire and release, a coroutine
per reply, a task per batch. Here one asyncio protocol owns one connection: ``request`` writes a
batch of already packed commands at once and returns a future for its ``n`` replies; replies are
parsed by hiredis in ``data_received`` and handed to the batches in order (Redis answers in order),
so any number of batches may be in flight on the one connection. Everything else the store does
(keys, heartbeat, pub/sub, usage) stays on redis-py.

Bounded: a reply's unparsed bytes are capped (``max_reply_bytes``: over it the connection is dropped);
every batch has a deadline (``timeout``); a batch still unanswered at its deadline closes the connection and fails every batch waiting on it (their replies could no longer be matched),
and the next request connects again (the connection attempt and handshake bounded the same way).
An error reply fails nothing: it is a ``ReplyError`` in its place in the result list.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

from .._compat import timeout as _timeout


class ReplyError(Exception):
    """An error reply from Redis (``NOSCRIPT ...``, ``WRONGTYPE ...``), in place of its result."""


def pack(*items: bytes) -> bytes:
    """One command in RESP (its arguments already bytes)."""
    out = [b"*%d\r\n" % len(items)]
    for item in items:
        out += (b"$%d\r\n" % len(item), item, b"\r\n")
    return b"".join(out)


# The most of one reply the pipe holds unparsed. The hot path's replies are a few integers per
# command; a Redis (or whatever answers on its port) that sends more is dropped, not buffered.
MAX_REPLY_BYTES = 16 << 20


class RespPipe:
    def __init__(self, url: str, timeout: float, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        u = urlsplit(url)
        if u.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {u.scheme!r}")
        self.timeout = timeout
        self.max_reply_bytes = max_reply_bytes
        self._unix = u.path if u.scheme == "unix" else None
        self._host, self._port = u.hostname or "localhost", u.port or 6379
        self._ssl = ssl.create_default_context() if u.scheme == "rediss" else None
        # The database as redis-py reads it: the path (redis://host/3) or ?db=3 (the only way for unix://).
        db = parse_qs(u.query).get("db", [""])[0] or (u.path.lstrip("/") if u.scheme != "unix" else "")
        self._hello: list[bytes] = []  # commands every new connection runs first
        if u.password is not None:
            user = [unquote(u.username).encode()] if u.username else []
            self._hello.append(pack(b"AUTH", *user, unquote(u.password).encode()))
        if db and db != "0":
            self._hello.append(pack(b"SELECT", db.encode()))
        self._transport: asyncio.Transport | None = None
        self._reader: Any = None
        self._connecting: asyncio.Task[None] | None = None
        self._queued: list[bytes] = []  # written once the connection is up
        self._waiting: deque[tuple[asyncio.Future[list[Any]] | None, int, list[Any], float]] = deque()  # None: the handshake
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        # The loop of the first request, kept: on 3.11 asyncio.get_running_loop() is a getpid() syscall each call.
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- requests ----------------------------------------------------------------------------------
    def request(self, packed: bytes, n: int) -> asyncio.Future[list[Any]]:
        """Send ``n`` packed commands in one write; the future gets their ``n`` replies, in order."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        if self._closed:
            fut.set_exception(ConnectionError("the Redis connection is closed"))
            return fut
        deadline = loop.time() + self.timeout
        self._waiting.append((fut, n, [], deadline))
        if self._transport is not None:
            self._transport.write(packed)
        else:
            self._queued.append(packed)
            if self._connecting is None:
                self._connecting = loop.create_task(self._connect())
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._check_deadline)
        return fut

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with _timeout(self.timeout):
                if self._unix is not None:
                    await loop.create_unix_connection(lambda: _Conn(self), self._unix)
                else:
                    await loop.create_connection(lambda: _Conn(self), self._host, self._port, ssl=self._ssl)
        except BaseException as exc:
            self._fail_all(exc if isinstance(exc, Exception) else ConnectionError("connect cancelled"))
        finally:
            self._connecting = None

    # -- the connection's events (from _Conn) -----------------------------------------------------------
    def _made(self, transport: asyncio.Transport) -> None:
        if self._closed:
            transport.abort()
            return
        self._transport = transport
        self._reader = hiredis.Reader(replyError=ReplyError)
        if self._hello:  # the handshake goes first (no future: checked as its replies arrive, see _received)
            self._waiting.appendleft((None, len(self._hello), [], asyncio.get_running_loop().time() + self.timeout))
            transport.write(b"".join(self._hello))
        queued, self._queued = self._queued, []
        if queued:
            transport.write(b"".join(queued))

    def _received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        while True:
            reply = reader.gets()
            if reply is False:
                if reader.len() > self.max_reply_bytes:
                    self._abort(ConnectionError(f"a Redis reply over {self.max_reply_bytes} bytes"))
                return
            if not waiting:  # a reply nobody asked for: the stream is out of step, start again
                self._abort(ConnectionError("unexpected reply from Redis"))
                return
            fut, n, got, _ = waiting[0]
            got.append(reply)
            if len(got) == n:
                waiting.popleft()
                if fut is None:  # the handshake: refused, nothing after it may run on this connection
                    errors = [r for r in got if isinstance(r, ReplyError)]
                    if errors:
                        self._abort(ConnectionError(f"Redis refused the connection's handshake: {errors[0]}"))
                        return
                elif not fut.done():
                    fut.set_result(got)

    def _lost(self, transport: asyncio.BaseTransport, exc: Exception | None) -> None:
        if transport is not self._transport:
            return  # one this pipe already dropped (its waiters already failed)
        self._transport = None
        self._fail_all(exc or ConnectionError("Redis closed the connection"))

    # -- deadlines and failure --------------------------------------------------------------------------
    def _check_deadline(self) -> None:
        """One timer, armed at the oldest batch's deadline (not one per batch)."""
        self._timer = None
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        deadline = self._waiting[0][3]
        if loop.time() >= deadline:
            self._abort(TimeoutError(f"Redis did not answer within {self.timeout:g}s"))
        else:
            self._timer = loop.call_at(deadline, self._check_deadline)

    def _abort(self, exc: Exception) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        self._queued = []
        waiting, self._waiting = self._waiting, deque()
        for fut, _, _, _ in waiting:
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        self._abort(ConnectionError("the Redis connection is closed"))


class _Conn(asyncio.Protocol):
    """One TCP connection's events, forwarded to its pipe; a connection the pipe dropped is ignored."""

    def __init__(self, pipe: RespPipe) -> None:
        self.pipe = pipe
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        self.pipe._made(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.transport is self.pipe._transport:
            self.pipe._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.pipe._lost(self.transport, exc)
