"""The pooled upstream client and the byte-level relay of responses.

One ``httpx.AsyncClient`` per process over the aiohttp transport (the plain httpx pool
collapses under concurrency; see bench/overhead.py). The URL is always a backend base plus a
constant route path. Timeouts: connect, first byte (response headers, and for streams the first
body chunk) and idle between chunks. Streams are relayed chunk by chunk as they arrive.
"""

from __future__ import annotations

import asyncio
import sys
from typing import AsyncIterator

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from .config import TimeoutsConfig

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.10
    from ._compat import timeout as _timeout

# Request headers a client may pass through; everything else is dropped (allow-list).
FORWARD_REQUEST_HEADERS = (b"accept", b"anthropic-version", b"anthropic-beta")
# Response headers a client may see from a backend.
FORWARD_RESPONSE_HEADERS = frozenset((b"content-type", b"retry-after"))


class UpstreamTimeout(Exception):
    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase  # "connect", "first_byte" or "idle"


def make_client(timeouts: TimeoutsConfig, max_connections: int = 4096, transport_name: str = "aiohttp") -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=4.0)
    common = dict(
        timeout=httpx.Timeout(connect=timeouts.connect, read=None, write=None, pool=timeouts.connect),
        headers={"accept-encoding": "identity", "user-agent": "lmdeploy-gateway"},
        follow_redirects=False,
        trust_env=False,
    )
    if transport_name == "httpx":
        return httpx.AsyncClient(limits=limits, **common)  # type: ignore[arg-type]

    def session() -> aiohttp.ClientSession:
        # keepalive below uvicorn's 5 s default, so we close idle sockets before the backend does.
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=4.0, ttl_dns_cache=300)
        return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))

    transport = AiohttpTransport(limits=limits, client=session, trust_env=False)
    return httpx.AsyncClient(transport=transport, **common)  # type: ignore[arg-type]


class Upstream:
    def __init__(self, client: httpx.AsyncClient, timeouts: TimeoutsConfig):
        self.client = client
        self.timeouts = timeouts

    async def open(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
        """POST and return once response headers arrived; UpstreamTimeout past the first-byte deadline."""
        request = self.client.build_request("POST", url, content=payload, headers=headers)
        try:
            async with _timeout(self.timeouts.first_byte):
                return await self.client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamTimeout("first_byte") from None
        except httpx.ConnectTimeout as exc:
            # The aiohttp transport maps every ClientConnectionError here; only a real timeout is one.
            if isinstance(exc.__cause__, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
                raise UpstreamTimeout("connect") from None
            raise

    async def chunks(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; the first within the first-byte deadline, then idle-bounded.

        The deadline covers only the wait for the backend, never the time a slow client takes to
        accept what we already relayed.
        """
        it = response.aiter_raw().__aiter__()
        limit, phase = self.timeouts.first_byte, "first_byte"
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

    async def read_all(self, response: httpx.Response) -> bytes:
        parts = [c async for c in self.chunks(response)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        await self.client.aclose()


def response_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in response.headers.raw if k.lower() in FORWARD_RESPONSE_HEADERS]


def is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


