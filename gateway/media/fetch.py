"""The inline fetch (``media.fetch: inline``): the gateway fetches allowed URLs itself and forwards bytes.

With it on, a backend never fetches anything from the network: every http(s) media URL that passed
the policy is fetched here and replaced by a base64 ``data:`` URL (a base64 source on
``/v1/messages``, ``file_data`` for a Responses ``input_file``). What each fetch guarantees:

- The host is resolved once, every address must be public (``addresses.is_global_address``), and
  the connection goes to one of exactly those addresses: the name is never resolved again, so a
  DNS-rebinding answer cannot move it. TLS is verified against the host name (SNI included).
- No proxy, no cookies, no credentials, ``Accept-Encoding: identity`` (a compressed answer is
  refused rather than inflated), one request per connection.
- Redirects: at most ``max_redirects``, each target parsed by the same strict URL parser and
  checked against the same domain set as the original, then resolved and checked again.
- Caps: the whole fetch, redirects included, within ``timeout``; the body within the per-item
  limit and the request's remaining total (counted as it arrives); headers within 16 KiB.
- The content is sniffed: it must start like one of the kind's allowed MIME types, and that type
  (the server's ``Content-Type`` when the bytes agree with it) is what the data URL declares.

Every failure is a ``MediaRefused`` with a reason; the walk's place is filled in by the caller.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Iterable

import h11

from .addresses import AddressCheck, Resolver, getaddrinfo, is_global_address
from .parts import KIND_NAMES
from .reasons import MediaRefused
from .signatures import HEAD_BYTES, sniff
from .url import DomainSet, MediaUrl, join_location, parse_media_url

__all__ = ["Budget", "MediaFetcher"]

REDIRECTS = frozenset({301, 302, 303, 307, 308})
_READ = 262144
_MAX_INFORMATIONAL = 8


class Budget:
    """Decoded bytes a request may still bring in: ``max_request_bytes`` less what its body already carries."""

    __slots__ = ("left", "limit")

    def __init__(self, left: int, limit: int):
        self.left = left
        self.limit = limit

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise MediaRefused("media_request_too_large", f"media in this request decodes to more than {self.limit} bytes in total")


class MediaFetcher:
    """Fetches one media URL under the rules above; shared by every request, bounded in concurrency."""

    def __init__(
        self,
        *,
        timeout: float = 10.0,
        max_redirects: int = 3,
        concurrency: int = 8,
        max_url_length: int = 4096,
        resolver: Resolver | None = None,
        ssl_context: ssl.SSLContext | None = None,
        address_allowed: AddressCheck = is_global_address,
        max_header_bytes: int = 16384,
    ):
        self.timeout = timeout
        self.max_redirects = max_redirects
        self.max_url_length = max_url_length
        self.resolver = resolver or getaddrinfo
        self.ssl_context = ssl_context or ssl.create_default_context()
        self.address_allowed = address_allowed
        self.max_header_bytes = max_header_bytes
        self._slots = asyncio.Semaphore(concurrency)

    async def fetch(self, url: MediaUrl, kind: str, mimes: Iterable[str], domains: DomainSet, max_bytes: int, budget: Budget, copies: int = 1) -> tuple[str, bytes]:
        """``(mime, content)`` of ``url``; ``copies``: how many places in the body will hold it (for the budget)."""
        try:
            # The time cap covers the wait for a free slot too, so a busy gateway answers in bounded time.
            return await asyncio.wait_for(self._fetch_in_slot(url, kind, tuple(mimes), domains, max_bytes, budget, copies), self.timeout)
        except asyncio.TimeoutError:
            raise MediaRefused("fetch_timeout", f"fetching the media from {url.host!r} took longer than {self.timeout:g} s") from None

    async def _fetch_in_slot(self, *args: Any) -> tuple[str, bytes]:
        async with self._slots:
            return await self._fetch(*args)

    async def _fetch(self, url: MediaUrl, kind: str, mimes: tuple[str, ...], domains: DomainSet, max_bytes: int, budget: Budget, copies: int) -> tuple[str, bytes]:
        hops = 0
        while True:
            status, headers, content = await self._get(url, max_bytes, budget, copies)
            if status not in REDIRECTS:
                break
            if hops == self.max_redirects:
                raise MediaRefused("fetch_too_many_redirects", f"the media host redirected more than {self.max_redirects} times")
            hops += 1
            url = self._redirect(url, headers, domains)
        if not content:
            raise MediaRefused("fetch_content_not_allowed", f"the media host {url.host!r} sent an empty body")
        declared = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
        mime = sniff(kind, mimes, content[:HEAD_BYTES], declared or None)
        if mime is None:
            raise MediaRefused(
                "fetch_content_not_allowed",
                f"the fetched content is not one of the allowed types for {KIND_NAMES[kind]} ({', '.join(mimes) or 'none'}) by its first bytes",
            )
        return mime, content

    def _redirect(self, url: MediaUrl, headers: dict[bytes, bytes], domains: DomainSet) -> MediaUrl:
        location = headers.get(b"location")
        if not location:
            raise MediaRefused("fetch_bad_response", "the media host answered with a redirect but no Location")
        try:
            target = parse_media_url(join_location(url, location.decode("latin-1")), self.max_url_length)
        except MediaRefused as exc:
            raise MediaRefused("fetch_redirect_refused", f"the media host redirected to a URL that is refused: {exc.why}") from None
        refused = domains.decide(target)
        if refused is not None:
            raise MediaRefused("fetch_redirect_refused", f"the media host redirected to a URL that is refused: {refused.why}")
        return target

    async def _addresses(self, url: MediaUrl) -> list[str]:
        try:
            addresses = await self.resolver(url.host, url.effective_port)
        except (OSError, UnicodeError):
            addresses = []
        if not addresses:
            raise MediaRefused("dns_failed", f"the host {url.host!r} could not be resolved")
        if not all(self.address_allowed(a) for a in addresses):
            raise MediaRefused("dns_non_global", f"the host {url.host!r} resolves to an address that is not public")
        return addresses

    async def _connect(self, url: MediaUrl) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        tls = url.scheme == "https"
        for address in await self._addresses(url):
            try:
                # Pinned: connect to the checked address; TLS still verifies the certificate for the name.
                return await asyncio.open_connection(
                    address, url.effective_port, ssl=self.ssl_context if tls else None, server_hostname=url.host if tls else None, limit=_READ
                )
            except ssl.SSLError:
                raise MediaRefused("fetch_failed", f"the TLS handshake with {url.host!r} failed (certificate not valid for the name, or not trusted)") from None
            except OSError:
                continue
        raise MediaRefused("fetch_failed", f"could not connect to the media host {url.host!r}")

    async def _get(self, url: MediaUrl, max_bytes: int, budget: Budget, copies: int) -> tuple[int, dict[bytes, bytes], bytes]:
        reader, writer = await self._connect(url)
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=self.max_header_bytes)
        host = url.host if url.port is None else f"{url.host}:{url.port}"
        headers = [("Host", host), ("User-Agent", "lmdeploy-gateway"), ("Accept", "*/*"), ("Accept-Encoding", "identity"), ("Connection", "close")]
        try:
            writer.write(conn.send(h11.Request(method="GET", target=url.target, headers=headers)) + conn.send(h11.EndOfMessage()))
            status, got, informational = 0, {}, 0
            body = bytearray()  # one growing buffer: a server that trickles bytes cannot make many small objects
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(_READ))
                elif isinstance(event, h11.InformationalResponse):
                    informational += 1
                    if informational > _MAX_INFORMATIONAL:
                        raise MediaRefused("fetch_bad_response", "the media host sent too many interim responses")
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    got = {k: v for k, v in event.headers}  # h11 lower-cases names
                    if status in REDIRECTS:
                        return status, got, b""
                    if status != 200:
                        raise MediaRefused("fetch_bad_status", f"the media host {url.host!r} answered with status {status}")
                    if got.get(b"content-encoding", b"identity").lower() != b"identity":
                        raise MediaRefused("fetch_bad_response", "the media host sent compressed content; only identity encoding is accepted")
                    length = got.get(b"content-length")
                    if length is not None and length.isdigit() and int(length) > max_bytes:
                        raise MediaRefused("media_item_too_large", f"the media host announced {int(length)} bytes, over the limit of {max_bytes} bytes per item")
                elif isinstance(event, h11.Data):
                    if len(body) + len(event.data) > max_bytes:
                        raise MediaRefused("media_item_too_large", f"the fetched item is over the limit of {max_bytes} bytes per item")
                    budget.take(len(event.data) * copies)
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return status, got, bytes(body)
                else:  # ConnectionClosed before the end of the message
                    raise MediaRefused("fetch_bad_response", "the media host closed the connection before the response was complete")
        except h11.ProtocolError:
            raise MediaRefused("fetch_bad_response", "the media host sent a malformed HTTP response") from None
        except (OSError, asyncio.IncompleteReadError):
            raise MediaRefused("fetch_failed", f"the connection to the media host {url.host!r} failed") from None
        finally:
            writer.transport.abort()
