"""The pooled upstream client and the byte-level relay of responses.

One client per process: ``NativeUpstream``, our keep-alive HTTP/1.1 client on asyncio +
httptools (``h1.py``), the leanest hot path (``bench/overhead.py`` measures what it adds).
``Upstream`` is its base: the deadlines and the limits that any client must keep (the tests'
fake upstream is the other subclass).

The httpx transports (``httpx``, ``httpx-aiohttp``) were dropped from the data plane: they cannot
hold the framing rule below. httpcore's h11 keeps bytes past the end of a response in its buffer
and parses them as the answer to the *next* request on that connection (an injected response
reached another client in tests/test_untrusted_backends.py), and httpx-aiohttp lets aiohttp's
parser errors escape as non-httpx exceptions. httpx on aiohttp's transport (``make_client``)
remains the control-plane client (health, metrics, models); ``control_call`` bounds its reads.

The URL is always a backend base plus a constant route path. Timeouts: connect, first byte
(response headers, and the first body chunk) and idle between chunks. Streams are relayed
chunk by chunk as they arrive, never re-framed.

Backends are untrusted (``UpstreamLimits``): only a final status (200-599) is a response; the
head is bounded in bytes and header count; a whole response is read up to
``max_response_bytes``; a stream may not go ``max_line_bytes`` without a newline. Anything else
is an ``UpstreamInvalid`` and the connection is closed, never reused. Framing (bytes after a
complete response) is checked by the client: ``h1.py`` closes such a connection the moment
the bytes arrive.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from ._compat import timeout as _timeout
from .config import TimeoutsConfig, UpstreamConfig
from .h1 import ConnectFailed, ConnectionLost, ConnectTimeout, H1Pool, H1Response, InvalidResponse
from .h1 import Timeout as H1Timeout

# Request headers a client may pass through; everything else is dropped (allow-list).
FORWARD_REQUEST_HEADERS = (b"accept", b"anthropic-version", b"anthropic-beta")
# Response headers a client may see from a backend.
FORWARD_RESPONSE_HEADERS = frozenset((b"content-type", b"retry-after"))
EVENTS_PER_LINE = 4  # an SSE event may hold a few lines of the longest size
_KEEPALIVE = 4.0  # below uvicorn's 5 s default, so we close idle sockets before the backend does


class UpstreamTimeout(Exception):
    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase  # "connect", "first_byte" or "idle"


class UpstreamFailure(Exception):
    """No (complete) answer: ``connect_refused`` (nothing was sent) or ``reset``."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class UpstreamInvalid(UpstreamFailure):
    """The backend's answer broke the protocol or a limit; ``reason`` says which (a metric label)."""

    def __init__(self, reason: str):
        super().__init__("invalid_response")
        self.reason = reason


class UpstreamResponse:
    """What the router needs of a response, whatever the client."""

    __slots__ = ("status", "headers", "declared_length", "_chunks", "_close", "_max_line", "_lined", "_whole", "_spoil")

    def __init__(
        self, status: int, headers: list[tuple[bytes, bytes]], chunks, close, declared_length: int | None = None, max_line: int = 0, lined=None, whole=None,
        spoil=None,
    ):
        self.status = status
        self.headers = headers  # only the allow-listed ones, lower-case names
        self.declared_length = declared_length  # the backend's Content-Length, if it sent one
        self._chunks = chunks
        self._close = close
        self._max_line = max_line
        # Optional: chunks(LineBound or None) that checks each chunk itself (one generator less per chunk).
        self._lined = lined
        # Optional: whole() -> the body if all of it has arrived, else None (read_all then needs no generator).
        self._whole = whole
        # Optional: spoil() -> the connection is never reused (a body over the cap that arrived whole is
        # well framed, but it broke our rules: the pool must not keep it).
        self._spoil = spoil

    @property
    def is_event_stream(self) -> bool:
        for k, v in self.headers:
            if k == b"content-type":
                return v.startswith(b"text/event-stream")
        return False

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (for streams): a line longer than the limit is UpstreamInvalid."""
        if self._lined is not None:
            return self._lined(LineBound(self._max_line) if self._max_line else None)
        return _line_bounded(self._chunks(), self._max_line) if self._max_line else self._chunks()

    async def aclose(self) -> None:
        await self._close()


class LineBound:
    """A stream's limits, checked chunk by chunk: no line longer than ``max_line`` and no SSE event
    longer than ``EVENTS_PER_LINE`` times that (UpstreamInvalid)."""

    __slots__ = ("max_line", "max_event", "line", "event", "tail")

    def __init__(self, max_line: int):
        self.max_line = max_line
        self.max_event = max_line * EVENTS_PER_LINE
        self.line = self.event = 0  # bytes since the last newline / the last blank line
        self.tail = b""  # the last byte of the previous chunk: a blank line may straddle two chunks

    def check(self, chunk: bytes) -> None:
        nl = chunk.rfind(b"\n")
        self.line = self.line + len(chunk) if nl < 0 else len(chunk) - nl - 1
        # The last blank line: a "\n\r\n" can only be the last one if it lies after the last
        # "\n\n", so only that tail is searched for it (one scan of the chunk, not two).
        end = chunk.rfind(b"\n\n")
        end = max(end, chunk.rfind(b"\n\r\n", end + 1))
        if end >= 0:
            self.event = len(chunk) - end - 2
        elif self.tail == b"\n" and (chunk.startswith(b"\n") or chunk.startswith(b"\r\n")):
            self.event = len(chunk)
        else:
            self.event += len(chunk)
        self.tail = chunk[-1:]
        if self.line > self.max_line:
            raise UpstreamInvalid("line_too_long")
        if self.event > self.max_event:
            raise UpstreamInvalid("event_too_long")


async def _line_bounded(chunks: AsyncIterator[bytes], max_line: int) -> AsyncIterator[bytes]:
    """Relays chunks while they keep within ``LineBound(max_line)``."""
    bound = LineBound(max_line)
    async for chunk in chunks:
        bound.check(chunk)
        yield chunk


def _declared_length(value: bytes | str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class Upstream:
    """Base: the deadline logic and the limits are shared; subclasses provide raw send and raw chunks."""

    def __init__(self, timeouts: TimeoutsConfig, limits: UpstreamConfig | None = None):
        self.timeouts = timeouts
        self.limits = limits or UpstreamConfig()

    async def open(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        """POST; return once a final response head arrived. Raises UpstreamTimeout or UpstreamFailure."""
        try:
            async with _timeout(self.timeouts.first_byte):
                response = await self._send(url, payload, headers)
        except TimeoutError:
            raise UpstreamTimeout("first_byte") from None
        return await self._final(response)

    @staticmethod
    async def _final(response: UpstreamResponse) -> UpstreamResponse:
        """Only a final status is a response."""
        if not 200 <= response.status <= 599:
            # A transport that skips interim responses itself may still hand over a 101.
            await response.aclose()
            raise UpstreamInvalid(f"status_{response.status}" if 100 <= response.status <= 199 else "bad_status")
        return response

    async def _bounded(self, raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Chunks, the first within the first-byte deadline, then each within the idle deadline.

        A deadline covers only the wait for the backend, never the time a slow client takes to
        accept what we already relayed.
        """
        limit, phase = self.timeouts.first_byte, "first_byte"
        it = raw.__aiter__()
        while True:
            try:
                async with _timeout(limit):
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UpstreamTimeout(phase) from None
            limit, phase = self.timeouts.idle, "idle"
            if chunk:
                yield chunk

    async def read_all(self, response: UpstreamResponse, limit: int | None = None) -> bytes:
        """The whole body, at most ``limit`` (default ``max_response_bytes``) bytes, or UpstreamInvalid."""
        limit = self.limits.max_response_bytes if limit is None else limit
        if response.declared_length is not None and response.declared_length > limit:
            raise UpstreamInvalid("body_too_large")
        if response._whole is not None:
            # All here already (a small answer arrives with its head): no generator, no wait.
            body = response._whole()
            if body is not None:
                if len(body) > limit:
                    raise self._too_large(response)
                return body
        parts: list[bytes] = []
        size = 0
        async for chunk in response._chunks():
            size += len(chunk)
            if size > limit:
                raise self._too_large(response)
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @staticmethod
    def _too_large(response: UpstreamResponse) -> UpstreamInvalid:
        """The refusal of a body over the cap; the caller's aclose() then drops the connection."""
        if response._spoil is not None:
            response._spoil()
        return UpstreamInvalid("body_too_large")

    async def read_some(self, response: UpstreamResponse, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body, for a log line; the rest is never read."""
        parts: list[bytes] = []
        size = 0
        async for chunk in response._chunks():
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return b"".join(parts)[:limit]

    async def _send(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class NativeUpstream(Upstream):
    """Our own keep-alive HTTP/1.1 client (gateway/h1.py): one write per request, no URL objects;
    its deadlines are timer handles on h1's waiters, and each chunk passes one generator."""

    def __init__(self, timeouts: TimeoutsConfig, limits: UpstreamConfig | None = None):
        super().__init__(timeouts, limits)
        self._targets: dict[str, tuple[H1Pool, bytes]] = {}
        self._pools: dict[tuple[str, str, int], H1Pool] = {}
        self._tls: ssl.SSLContext | None = None

    def _target(self, url: str) -> tuple[H1Pool, bytes]:
        """The pool and the request-line prefix for one (backend, route) URL, built once."""
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        key = (scheme, host, port)
        pool = self._pools.get(key)
        if pool is None:
            tls = None
            if scheme == "https":
                tls = self._tls = self._tls or ssl.create_default_context()
            pool = self._pools[key] = H1Pool(
                host, port, self.timeouts.connect, tls, max_header_bytes=self.limits.max_header_bytes, max_headers=self.limits.max_headers
            )
        netloc = parts.netloc.encode("ascii")
        prefix = b"POST " + parts.path.encode("ascii") + b" HTTP/1.1\r\nhost: " + netloc + b"\r\ncontent-type: application/json\r\n"
        self._targets[url] = (pool, prefix)
        return pool, prefix

    async def open(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        # The first-byte deadline is kept by h1 itself (a timer on the head's waiter), not by a timeout context.
        target = self._targets.get(url) or self._target(url)
        pool, prefix = target
        lines = [prefix, b"content-length: ", str(len(payload)).encode(), b"\r\n"]
        for k, v in headers:
            if k != b"content-type":
                lines += (k, b": ", v, b"\r\n")
        lines.append(b"\r\n")
        try:
            resp = await pool.request(b"".join(lines), payload, self.timeouts.first_byte)
        except H1Timeout:
            raise UpstreamTimeout("first_byte") from None
        except ConnectFailed:
            raise UpstreamFailure("connect_refused") from None
        except ConnectTimeout:
            raise UpstreamTimeout("connect") from None
        except ConnectionLost:
            raise UpstreamFailure("reset") from None
        except InvalidResponse as exc:
            raise UpstreamInvalid(exc.reason) from None

        headers_out = []
        declared = None
        for k, v in resp.headers:
            if k in FORWARD_RESPONSE_HEADERS:
                headers_out.append((k, v))
            elif k == b"content-length":
                declared = _declared_length(v)
        return await self._final(UpstreamResponse(
            resp.status, headers_out, lambda: self._chunks(resp, None), resp.aclose, declared, self.limits.max_line_bytes,
            lambda bound: self._chunks(resp, bound), resp.whole, resp.spoil,
        ))

    async def _chunks(self, resp: H1Response, bound: LineBound | None) -> AsyncIterator[bytes]:
        """The body as it arrives, in one generator: the first chunk within the first-byte deadline,
        each next within the idle one (only the wait for the backend counts, as in ``_bounded``),
        and the stream's line limits when ``bound`` is given."""
        limit, phase = self.timeouts.first_byte, "first_byte"
        idle = self.timeouts.idle
        try:
            while True:
                # Bytes already here (a stream's frames usually arrive with its head, or several in
                # one read) are taken without a coroutine and a wait: the deadline is for waiting.
                chunk = resp.buffered()
                if chunk is None:
                    chunk = await resp.next_chunk(limit)
                    if chunk is None:
                        return
                limit, phase = idle, "idle"
                if bound is not None:
                    bound.check(chunk)
                yield chunk
        except H1Timeout:
            raise UpstreamTimeout(phase) from None
        except ConnectionLost:
            raise UpstreamFailure("reset") from None
        except InvalidResponse as exc:
            raise UpstreamInvalid(exc.reason) from None

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()


async def control_call(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    limit: int,
    timeout: float,
    headers: dict[str, str] | list[tuple[bytes, bytes]] | None = None,
    content: bytes | None = None,
) -> tuple[int, bytes | None]:
    """A control-plane call (health, /metrics, /v1/models, /distserve/*) whose answer is read up to
    ``limit`` bytes: (status, body), or (status, None) for a longer one, which is never read whole.
    Backends are untrusted; every control-plane read goes through here."""
    async with client.stream(method, url, headers=headers, content=content, timeout=timeout) as r:
        body = bytearray()
        async for chunk in r.aiter_bytes():
            body += chunk
            if len(body) > limit:
                return r.status_code, None
        return r.status_code, bytes(body)


def make_client(timeouts: TimeoutsConfig, max_connections: int = 256, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The control-plane httpx client (health checks, metrics scraping, model discovery), on
    aiohttp's transport; a test may hand it another ``transport`` (httpx's own, for respx)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=_KEEPALIVE)
    common = dict(
        timeout=httpx.Timeout(connect=timeouts.connect, read=None, write=None, pool=timeouts.connect),
        headers={"accept-encoding": "identity", "user-agent": "lmdeploy-gateway"},
        follow_redirects=False,
        trust_env=False,
    )
    if transport is not None:
        return httpx.AsyncClient(transport=transport, **common)  # type: ignore[arg-type]

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE, ttl_dns_cache=300)
        return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))

    transport = AiohttpTransport(limits=limits, client=session, trust_env=False)
    return httpx.AsyncClient(transport=transport, **common)  # type: ignore[arg-type]
