"""The pooled upstream client and the byte-level relay of responses.

One client per process, chosen by ``upstream.transport`` and measured side by side in
``bench/overhead.py``:

- ``native`` (default): our keep-alive HTTP/1.1 client on asyncio + httptools (``h1.py``). The
  leanest hot path.
- ``aiohttp``: an aiohttp ``ClientSession`` used directly, with the request URL of each
  (backend, route) pair built once.
- ``httpx-aiohttp``: an ``httpx.AsyncClient`` over the aiohttp transport of ``httpx-aiohttp``.
- ``httpx``: httpx with its own connection pool, which collapses under concurrency; kept only so
  the benchmark can show it.

The URL is always a backend base plus a constant route path. Timeouts: connect, first byte
(response headers, and the first body chunk) and idle between chunks. Streams are relayed
chunk by chunk as they arrive, never re-framed.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from typing import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from yarl import URL

from .config import TimeoutsConfig
from .h1 import ConnectFailed, ConnectionLost, ConnectTimeout, H1Pool

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.10
    from ._compat import timeout as _timeout

# Request headers a client may pass through; everything else is dropped (allow-list).
FORWARD_REQUEST_HEADERS = (b"accept", b"anthropic-version", b"anthropic-beta")
# Response headers a client may see from a backend.
FORWARD_RESPONSE_HEADERS = frozenset((b"content-type", b"retry-after"))
TRANSPORTS = ("native", "aiohttp", "httpx-aiohttp", "httpx")
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


class UpstreamResponse:
    """What the router needs of a response, whatever the transport."""

    __slots__ = ("status", "headers", "_chunks", "_close")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], chunks, close):
        self.status = status
        self.headers = headers  # only the allow-listed ones, lower-case names
        self._chunks = chunks
        self._close = close

    @property
    def is_event_stream(self) -> bool:
        for k, v in self.headers:
            if k == b"content-type":
                return v.startswith(b"text/event-stream")
        return False

    def chunks(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def aclose(self) -> None:
        await self._close()


class Upstream:
    """Base: the deadline logic is shared; subclasses provide raw send and raw chunks."""

    def __init__(self, timeouts: TimeoutsConfig):
        self.timeouts = timeouts

    async def open(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        """POST; return once response headers arrived. Raises UpstreamTimeout or UpstreamFailure."""
        try:
            async with _timeout(self.timeouts.first_byte):
                return await self._send(url, payload, headers)
        except TimeoutError:
            raise UpstreamTimeout("first_byte") from None

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

    async def read_all(self, response: UpstreamResponse) -> bytes:
        parts = [c async for c in response.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _send(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class AiohttpUpstream(Upstream):
    def __init__(self, timeouts: TimeoutsConfig, max_connections: int):
        super().__init__(timeouts)
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect, connect=timeouts.connect),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._urls: dict[str, URL] = {}

    async def _send(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        u = self._urls.get(url)
        if u is None:
            u = self._urls[url] = URL(url, encoded=True)  # our own constant: no normalisation needed
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            resp = await self.session.request("POST", u, data=payload, headers=hdrs, allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError) or isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise UpstreamTimeout("connect") from None
            raise UpstreamFailure("connect_refused") from None
        except (aiohttp.ConnectionTimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamTimeout("connect") from None
        except (aiohttp.ClientError, OSError):
            raise UpstreamFailure("reset") from None

        async def raw() -> AsyncIterator[bytes]:
            try:
                while True:
                    chunk = await resp.content.readany()
                    if not chunk:
                        return
                    yield chunk
            except (aiohttp.ClientError, OSError):
                raise UpstreamFailure("reset") from None

        async def close() -> None:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()  # drop the connection: the backend sees its client leave and stops generating

        headers_out = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() in FORWARD_RESPONSE_HEADERS]
        return UpstreamResponse(resp.status, headers_out, lambda: self._bounded(raw()), close)

    async def aclose(self) -> None:
        await self.session.close()


class NativeUpstream(Upstream):
    """Our own keep-alive HTTP/1.1 client (gateway/h1.py): one write per request, no URL objects."""

    def __init__(self, timeouts: TimeoutsConfig):
        super().__init__(timeouts)
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
            pool = self._pools[key] = H1Pool(host, port, self.timeouts.connect, tls)
        netloc = parts.netloc.encode("ascii")
        prefix = b"POST " + parts.path.encode("ascii") + b" HTTP/1.1\r\nhost: " + netloc + b"\r\ncontent-type: application/json\r\n"
        self._targets[url] = (pool, prefix)
        return pool, prefix

    async def _send(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        target = self._targets.get(url) or self._target(url)
        pool, prefix = target
        lines = [prefix, b"content-length: ", str(len(payload)).encode(), b"\r\n"]
        for k, v in headers:
            if k != b"content-type":
                lines += (k, b": ", v, b"\r\n")
        lines.append(b"\r\n")
        try:
            resp = await pool.request(b"".join(lines), payload)
        except ConnectFailed:
            raise UpstreamFailure("connect_refused") from None
        except ConnectTimeout:
            raise UpstreamTimeout("connect") from None
        except ConnectionLost:
            raise UpstreamFailure("reset") from None

        async def raw() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.chunks():
                    yield chunk
            except ConnectionLost:
                raise UpstreamFailure("reset") from None

        headers_out = [(k, v) for k, v in resp.headers if k in FORWARD_RESPONSE_HEADERS]
        return UpstreamResponse(resp.status, headers_out, lambda: self._bounded(raw()), resp.aclose)

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()


class HttpxUpstream(Upstream):
    def __init__(self, client: httpx.AsyncClient, timeouts: TimeoutsConfig):
        super().__init__(timeouts)
        self.client = client

    async def _send(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        request = self.client.build_request("POST", url, content=payload, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.ConnectError:
            raise UpstreamFailure("connect_refused") from None
        except httpx.ConnectTimeout as exc:
            # The aiohttp transport maps every ClientConnectionError here; only a real timeout is one.
            cause = exc.__cause__
            if cause is None or isinstance(cause, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
                raise UpstreamTimeout("connect") from None
            raise UpstreamFailure("connect_refused" if isinstance(cause, aiohttp.ClientConnectorError) else "reset") from None
        except httpx.TransportError:
            raise UpstreamFailure("reset") from None

        async def raw() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.TransportError:
                raise UpstreamFailure("reset") from None

        headers_out = [(k.lower(), v) for k, v in resp.headers.raw if k.lower() in FORWARD_RESPONSE_HEADERS]
        return UpstreamResponse(resp.status_code, headers_out, lambda: self._bounded(raw()), resp.aclose)

    async def aclose(self) -> None:
        await self.client.aclose()


def make_client(timeouts: TimeoutsConfig, max_connections: int = 256, transport_name: str = "httpx-aiohttp") -> httpx.AsyncClient:
    """An httpx client (health checks, metrics scraping, and the httpx transports above)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=_KEEPALIVE)
    common = dict(
        timeout=httpx.Timeout(connect=timeouts.connect, read=None, write=None, pool=timeouts.connect),
        headers={"accept-encoding": "identity", "user-agent": "lmdeploy-gateway"},
        follow_redirects=False,
        trust_env=False,
    )
    if transport_name == "httpx":
        return httpx.AsyncClient(limits=limits, **common)  # type: ignore[arg-type]

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE, ttl_dns_cache=300)
        return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))

    transport = AiohttpTransport(limits=limits, client=session, trust_env=False)
    return httpx.AsyncClient(transport=transport, **common)  # type: ignore[arg-type]


def make_upstream(transport: str, timeouts: TimeoutsConfig, max_connections: int) -> Upstream:
    if transport == "native":
        return NativeUpstream(timeouts)
    if transport == "aiohttp":
        return AiohttpUpstream(timeouts, max_connections)
    return HttpxUpstream(make_client(timeouts, max_connections, transport), timeouts)
