"""The inline fetch (``media.fetch: inline``), rule by rule, against a local TLS server on loopback.

Every test stays on 127.0.0.1: names are answered by an injected resolver, the server's
certificate comes from a throw-away CA (trustme) that only the test's SSL context trusts, and the
loopback address is let through by an address check injected here and nowhere else (the config
has no such knob). ``test_loopback_is_refused_by_the_default_address_check`` shows the same
fetch refused once that test-only allowance is gone.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import http.server
import ssl
import threading
from collections import Counter
from typing import Any, Iterator

import pytest
import trustme

from gateway.config.media import MediaConfig
from gateway.filters.media import MediaPolicy
from gateway.media import REASONS, is_global_address, parse_media_url
from gateway.media.fetch import Budget, MediaFetcher
from gateway.media.reasons import NETWORK_REASONS
from gateway.media.url import DomainSet, join_location
from test_media_policy import JPEG, PDF, PNG, a_url, anth, chat, chat_raw, context, img, refused_count, resp

pytestmark = pytest.mark.e2e

NAMES = ["media.test", "*.cdn.test", "evil.test", "closed.test"]
BIG = 4096  # max_item_bytes in these tests


class MediaServer:
    """A small HTTPS server: one behaviour per path, a hit count per path, released by the test at the end."""

    def __init__(self, ca: trustme.CA | None):
        self.hits: Counter[str] = Counter()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                path = self.path
                outer.hits[path.split("?")[0]] += 1
                outer.route(self, path)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.scheme = "http"
        if ca is not None:  # None: plain http, for entries written http://host
            server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ca.issue_cert(*NAMES).configure_cert(server_ctx)
            self.httpd.socket = server_ctx.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "media.test") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def route(self, h: http.server.BaseHTTPRequestHandler, path: str) -> None:
        def answer(status: int, body: bytes = b"", **headers: str) -> None:
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k.replace("_", "-"), v)
            if "Content_Length" not in headers and status != 204:
                h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)

        p = path.split("?")[0]
        if p in ("/cat.png", "/a/cat.png"):
            answer(200, PNG, Content_Type="image/png")
        elif p == "/cat.jpg":
            answer(200, JPEG, Content_Type="image/jpeg")
        elif p == "/png-labelled-jpeg":
            answer(200, PNG, Content_Type="image/jpeg")
        elif p == "/no-type":
            answer(200, PNG)
        elif p == "/doc.pdf":
            answer(200, PDF, Content_Type="application/pdf")
        elif p == "/page.html":
            answer(200, b"<html><script>alert(1)</script></html>", Content_Type="image/png")
        elif p == "/empty":
            answer(200, b"", Content_Type="image/png")
        elif p == "/announced-big":
            h.send_response(200)
            h.send_header("Content-Length", str(BIG + 1))
            h.end_headers()
            h.wfile.write(PNG)  # the fetcher must stop at the header
        elif p == "/streamed-big":
            h.send_response(200)  # no length: the body runs until the connection closes
            h.end_headers()
            h.wfile.write(PNG + bytes(BIG))
        elif p == "/half.png":
            answer(200, PNG, Content_Length=str(len(PNG) + 100))  # closes before the promised length
        elif p == "/gzip":
            answer(200, PNG, Content_Type="image/png", Content_Encoding="gzip")
        elif p == "/missing":
            answer(404, b"not here")
        elif p == "/redirect-relative":
            answer(302, Location="a/cat.png")
        elif p == "/redirect-absolute-path":
            answer(301, Location="/cat.png")
        elif p == "/redirect-full":
            answer(307, Location=self.url("/cat.png"))
        elif p == "/redirect-wildcard":
            answer(308, Location=self.url("/cat.png", "img.cdn.test"))
        elif p == "/redirect-off-list":
            answer(302, Location=self.url("/cat.png", "evil.test"))
        elif p == "/redirect-http":
            answer(302, Location=f"http://media.test:{self.port}/cat.png")
        elif p == "/redirect-file":
            answer(302, Location="file:///etc/passwd")
        elif p == "/redirect-ip":
            answer(302, Location=f"https://127.0.0.1:{self.port}/cat.png")
        elif p == "/redirect-userinfo":
            answer(302, Location=f"https://media.test:{self.port}@evil.test/cat.png")
        elif p == "/redirect-other-port":
            answer(302, Location="https://media.test/cat.png")
        elif p == "/redirect-no-location":
            answer(302)
        elif p.startswith("/hop"):
            n = int(p[4:] or 0)
            answer(302, Location=f"/hop{n + 1}" if n < 5 else "/cat.png")
        elif p == "/loop":
            answer(302, Location="/loop")
        elif p == "/slow":
            self.release.wait(30)
            answer(200, PNG, Content_Type="image/png")
        elif p == "/garbage":
            h.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
        else:
            answer(404)

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server(ca: trustme.CA) -> Iterator[MediaServer]:
    s = MediaServer(ca)
    yield s
    s.stop()


@pytest.fixture
def client_ssl(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


ANSWERS: dict[str, list[str]] = {
    "media.test": ["127.0.0.1"],
    "img.cdn.test": ["127.0.0.1"],
    "evil.test": ["127.0.0.1"],
    "closed.test": ["127.0.0.1"],
    "wrongcert.test": ["127.0.0.1"],
    "private.test": ["10.1.2.3"],
    "mixed.test": ["127.0.0.1", "10.1.2.3"],
    "mapped.test": ["::ffff:127.0.0.1"],
    "empty.test": [],
}


def resolver_for(answers: dict[str, list[str]], calls: list[str] | None = None):
    async def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in answers:
            raise OSError("no such host")
        return list(answers[host])

    return resolve


def loopback_for_tests(address: str) -> bool:
    """The test-only allowance: the local server's 127.0.0.1; every other non-public address stays refused."""
    return address == "127.0.0.1" or is_global_address(address)


def fetcher(client_ssl: ssl.SSLContext, *, timeout: float = 5.0, max_redirects: int = 3, check=loopback_for_tests, calls=None) -> MediaFetcher:
    return MediaFetcher(
        timeout=timeout, max_redirects=max_redirects, resolver=resolver_for(ANSWERS, calls), ssl_context=client_ssl, address_allowed=check
    )


def domains(server: MediaServer) -> DomainSet:
    p = server.port
    return DomainSet.parse(
        [f"media.test:{p}", f"*.cdn.test:{p}", f"closed.test:1", f"wrongcert.test:{p}", f"private.test:{p}", f"mixed.test:{p}", f"mapped.test:{p}", f"empty.test:{p}", f"nowhere.test:{p}"]
    )


def fetch(f: MediaFetcher, server: MediaServer, url: str, kind: str = "image", mimes=("image/png", "image/jpeg"), budget: int = 1 << 20):
    return asyncio.run(f.fetch(parse_media_url(url), kind, mimes, domains(server), BIG, Budget(budget, budget)))


# -- one row per rule: what a URL fetches to, or the reason it is refused ---------------------------------------------

FETCH_CASES: list[tuple[str, str, str, str | None]] = [
    # (id, host, path, expected reason or None for a fetch that succeeds)
    ("plain png", "media.test", "/cat.png", None),
    ("jpeg", "media.test", "/cat.jpg", None),
    ("wildcard host", "img.cdn.test", "/cat.png", None),
    ("declared type disagrees with the bytes: sniffed", "media.test", "/png-labelled-jpeg", None),
    ("no content type: sniffed", "media.test", "/no-type", None),
    ("relative redirect", "media.test", "/redirect-relative", None),
    ("absolute-path redirect", "media.test", "/redirect-absolute-path", None),
    ("full redirect", "media.test", "/redirect-full", None),
    ("redirect to an allowed wildcard host", "media.test", "/redirect-wildcard", None),
    ("html served as png", "media.test", "/page.html", "fetch_content_not_allowed"),
    ("empty body", "media.test", "/empty", "fetch_content_not_allowed"),
    ("announced over the item cap", "media.test", "/announced-big", "media_item_too_large"),
    ("streamed over the item cap", "media.test", "/streamed-big", "media_item_too_large"),
    ("closed before the promised length", "media.test", "/half.png", "fetch_bad_response"),
    ("compressed", "media.test", "/gzip", "fetch_bad_response"),
    ("not HTTP", "media.test", "/garbage", "fetch_bad_response"),
    ("404", "media.test", "/missing", "fetch_bad_status"),
    ("redirect off the allow-list", "media.test", "/redirect-off-list", "fetch_redirect_refused"),
    ("redirect to plain http", "media.test", "/redirect-http", "fetch_redirect_refused"),
    ("redirect to a file", "media.test", "/redirect-file", "fetch_redirect_refused"),
    ("redirect to an IP literal", "media.test", "/redirect-ip", "fetch_redirect_refused"),
    ("redirect with userinfo", "media.test", "/redirect-userinfo", "fetch_redirect_refused"),
    ("redirect to a port the entry does not name", "media.test", "/redirect-other-port", "fetch_redirect_refused"),
    ("redirect without a Location", "media.test", "/redirect-no-location", "fetch_bad_response"),
    ("too many redirects", "media.test", "/hop0", "fetch_too_many_redirects"),
    ("redirect loop", "media.test", "/loop", "fetch_too_many_redirects"),
    ("name resolves to a private address", "private.test", "/cat.png", "dns_non_global"),
    ("one of the answers is private", "mixed.test", "/cat.png", "dns_non_global"),
    ("IPv4-mapped loopback", "mapped.test", "/cat.png", "dns_non_global"),
    ("no answer", "empty.test", "/cat.png", "dns_failed"),
    ("resolver error", "nowhere.test", "/cat.png", "dns_failed"),
    ("certificate not for the name", "wrongcert.test", "/cat.png", "fetch_failed"),
]


@pytest.mark.parametrize("id, host, path, reason", FETCH_CASES, ids=[c[0] for c in FETCH_CASES])
def test_fetch_rules(server: MediaServer, client_ssl: ssl.SSLContext, id: str, host: str, path: str, reason: str | None):
    f = fetcher(client_ssl)
    if reason is None:
        mime, content = fetch(f, server, server.url(path, host))
        assert (mime, content) == ("image/jpeg", JPEG) if path == "/cat.jpg" else ("image/png", PNG)
        return
    with pytest.raises(Exception) as exc:
        fetch(f, server, server.url(path, host))
    assert getattr(exc.value, "reason", None) == reason, exc.value
    assert exc.value.why and "127.0.0.1" not in exc.value.why


def test_every_network_reason_has_a_row():
    covered = {c[3] for c in FETCH_CASES} | {"fetch_timeout", "fetch_failed", "media_request_too_large"}
    assert NETWORK_REASONS <= covered and NETWORK_REASONS <= set(REASONS)


def test_closed_port_is_a_fetch_failure(server: MediaServer, client_ssl: ssl.SSLContext):
    with pytest.raises(Exception) as exc:
        fetch(fetcher(client_ssl), server, "https://closed.test:1/cat.png")
    assert exc.value.reason == "fetch_failed"


def test_time_cap_covers_the_whole_fetch(server: MediaServer, client_ssl: ssl.SSLContext):
    with pytest.raises(Exception) as exc:
        fetch(fetcher(client_ssl, timeout=0.3), server, server.url("/slow"))
    assert exc.value.reason == "fetch_timeout" and "0.3 s" in exc.value.why


def test_concurrency_cap_holds_and_the_wait_counts_against_the_time_cap(server: MediaServer, client_ssl: ssl.SSLContext):
    f = MediaFetcher(timeout=0.3, concurrency=1, resolver=resolver_for(ANSWERS), ssl_context=client_ssl, address_allowed=loopback_for_tests)
    before = server.hits["/no-type"]

    async def two() -> list[Any]:
        d = domains(server)
        slow = f.fetch(parse_media_url(server.url("/slow")), "image", ("image/png",), d, BIG, Budget(BIG, BIG))
        queued = f.fetch(parse_media_url(server.url("/no-type")), "image", ("image/png",), d, BIG, Budget(BIG, BIG))
        return await asyncio.gather(slow, queued, return_exceptions=True)

    results = asyncio.run(two())
    assert [getattr(r, "reason", r) for r in results] == ["fetch_timeout", "fetch_timeout"]
    assert server.hits["/no-type"] == before, "the queued fetch ran beside the one holding the only slot"


def test_plain_http_only_where_the_entry_allows_it(client_ssl: ssl.SSLContext):
    plain = MediaServer(None)
    try:
        f = fetcher(client_ssl)
        url = parse_media_url(plain.url("/cat.png"))
        allowed = DomainSet.parse([f"http://media.test:{plain.port}"])
        assert asyncio.run(f.fetch(url, "image", ("image/png",), allowed, BIG, Budget(BIG, BIG))) == ("image/png", PNG)
        assert asyncio.run(f.fetch(parse_media_url(plain.url("/redirect-relative")), "image", ("image/png",), allowed, BIG, Budget(BIG, BIG)))[1] == PNG
        https_only = DomainSet.parse([f"media.test:{plain.port}"])
        policy = MediaPolicy(MediaConfig(allowed_domains=https_only.texts, fetch="inline"), fetcher=f)
        refusal = asyncio.run(policy.check_body_async(context("chat", chat(img(plain.url("/cat.png"))))))
        assert refusal.reason == "http_not_allowed" and plain.hits["/cat.png"] == 1
    finally:
        plain.stop()


def test_redirect_count_is_the_configured_one(server: MediaServer, client_ssl: ssl.SSLContext):
    assert fetch(fetcher(client_ssl, max_redirects=6), server, server.url("/hop0")) == ("image/png", PNG)
    with pytest.raises(Exception) as exc:
        fetch(fetcher(client_ssl, max_redirects=0), server, server.url("/redirect-full"))
    assert exc.value.reason == "fetch_too_many_redirects"


def test_request_budget_counts_fetched_bytes(server: MediaServer, client_ssl: ssl.SSLContext):
    with pytest.raises(Exception) as exc:
        fetch(fetcher(client_ssl), server, server.url("/cat.png"), budget=len(PNG) - 1)
    assert exc.value.reason == "media_request_too_large"


def test_kind_decides_what_the_sniff_accepts(server: MediaServer, client_ssl: ssl.SSLContext):
    assert fetch(fetcher(client_ssl), server, server.url("/doc.pdf"), "document", ("application/pdf",)) == ("application/pdf", PDF)
    with pytest.raises(Exception) as exc:
        fetch(fetcher(client_ssl), server, server.url("/cat.png"), "document", ("application/pdf",))
    assert exc.value.reason == "fetch_content_not_allowed"


def test_loopback_is_refused_by_the_default_address_check(server: MediaServer, client_ssl: ssl.SSLContext):
    """Without the test-only allowance, a name that resolves to 127.0.0.1 never gets a connection."""
    before = server.hits["/cat.png"]
    with pytest.raises(Exception) as exc:
        fetch(fetcher(client_ssl, check=is_global_address), server, server.url("/cat.png"))
    assert exc.value.reason == "dns_non_global"
    assert server.hits["/cat.png"] == before, "the server was contacted"


def test_each_hop_is_resolved_once_and_the_connection_pinned(server: MediaServer, client_ssl: ssl.SSLContext):
    calls: list[str] = []
    assert fetch(fetcher(client_ssl, calls=calls), server, server.url("/redirect-wildcard")) == ("image/png", PNG)
    assert calls == ["media.test", "img.cdn.test"]


def test_redirect_target_resolving_to_a_private_address_is_refused(server: MediaServer, client_ssl: ssl.SSLContext):
    answers = {**ANSWERS, "img.cdn.test": ["192.168.1.5"]}
    f = MediaFetcher(resolver=resolver_for(answers), ssl_context=client_ssl, address_allowed=loopback_for_tests)
    with pytest.raises(Exception) as exc:
        fetch(f, server, server.url("/redirect-wildcard"))
    assert exc.value.reason == "dns_non_global"


@pytest.mark.parametrize(
    "address, public",
    [
        ("8.8.8.8", True),
        ("93.184.216.34", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("127.255.255.254", False),
        ("10.0.0.1", False),
        ("172.16.0.1", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("255.255.255.255", False),
        ("224.0.0.251", False),
        ("240.0.0.1", False),
        ("192.0.2.1", False),
        ("198.18.0.1", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fe80::1%eth0", False),
        ("fc00::1", False),
        ("fd12:3456::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("64:ff9b::a00:1", False),
        ("2002:7f00:1::1", False),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),
        ("2001:db8::1", False),
        ("not an address", False),
    ],
)
def test_address_check(address: str, public: bool):
    assert is_global_address(address) is public


@pytest.mark.parametrize(
    "base, location, joined",
    [
        ("https://a.test/x/y.png?q=1", "z.png", "https://a.test/x/z.png"),
        ("https://a.test/x/y.png", "/z.png", "https://a.test/z.png"),
        ("https://a.test:8443/x/y.png", "/z.png", "https://a.test:8443/z.png"),
        ("https://a.test/x/y.png", "//b.test/z.png", "https://b.test/z.png"),
        ("https://a.test/x/y.png", "?v=2", "https://a.test/x/y.png?v=2"),
        ("https://a.test", "z.png", "https://a.test/z.png"),
        ("https://a.test/x", "https://b.test/y", "https://b.test/y"),
        ("https://a.test/x", "file:///etc/passwd", "file:///etc/passwd"),
    ],
)
def test_redirect_locations_join_like_rfc_3986(base: str, location: str, joined: str):
    assert join_location(parse_media_url(base), location) == joined


# -- through the filter: what the backend receives ------------------------------------------------------------------------


def inline_policy(server: MediaServer, client_ssl: ssl.SSLContext, **media: Any) -> MediaPolicy:
    cfg = MediaConfig(allowed_domains=(f"media.test:{server.port}", f"*.cdn.test:{server.port}"), fetch="inline", max_item_bytes=BIG, **media)
    f = MediaFetcher(timeout=5, resolver=resolver_for(ANSWERS), ssl_context=client_ssl, address_allowed=loopback_for_tests)
    policy = MediaPolicy(cfg, fetcher=f)
    assert policy.is_async
    return policy


def run(policy: MediaPolicy, route: str, body: dict[str, Any], key=None):
    ctx = context(route, body, key)
    return asyncio.run(policy.check_body_async(ctx))


D_PNG_INLINE = "data:image/png;base64," + base64.b64encode(PNG).decode()


def test_chat_urls_are_replaced_by_the_fetched_bytes(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    body = chat(img(server.url("/cat.png")), {"type": "image_url", "image_url": server.url("/redirect-relative")}, img(D_PNG_INLINE))
    assert run(policy, "chat", body) is None
    parts = body["messages"][0]["content"]
    assert parts[1] == img(D_PNG_INLINE) and parts[2] == {"type": "image_url", "image_url": D_PNG_INLINE} and parts[3] == img(D_PNG_INLINE)


def test_anthropic_url_source_becomes_a_base64_source(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    body = anth(a_url(server.url("/cat.jpg")), a_url(server.url("/doc.pdf"), "document"))
    assert run(policy, "messages", body) is None
    blocks = body["messages"][0]["content"]
    assert blocks[1] == {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(JPEG).decode()}}
    assert blocks[2]["source"] == {"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(PDF).decode()}


def test_responses_file_url_becomes_file_data(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    body = resp({"type": "input_file", "file_url": server.url("/doc.pdf"), "filename": "a.pdf"}, {"type": "input_image", "image_url": server.url("/cat.png")})
    assert run(policy, "responses", body) is None
    parts = body["input"][0]["content"]
    assert parts[1] == {"type": "input_file", "file_data": "data:application/pdf;base64," + base64.b64encode(PDF).decode(), "filename": "a.pdf"}
    assert parts[2] == {"type": "input_image", "image_url": D_PNG_INLINE}


def test_image_data_and_repeated_urls_are_fetched_once(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    url = server.url("/a/cat.png")
    before = server.hits["/a/cat.png"]
    body = chat_raw([], image_data=[url, {"url": url}])
    assert run(policy, "chat", body) is None
    assert body["image_data"] == [D_PNG_INLINE, {"url": D_PNG_INLINE}]
    assert server.hits["/a/cat.png"] == before + 1


def test_a_failed_fetch_refuses_the_request_naming_the_place(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    body = chat(img(server.url("/cat.png")), img(server.url("/page.html")))
    original = copy.deepcopy(body)
    before = refused_count("fetch_content_not_allowed")
    refusal = run(policy, "chat", body)
    assert (refusal.status, refusal.reason, refusal.param) == (400, "fetch_content_not_allowed", "messages[0].content[2].image_url.url")
    assert "page.html" not in refusal.message and refused_count("fetch_content_not_allowed") == before + 1
    assert original["messages"][0]["content"][2] == body["messages"][0]["content"][2]


def test_fetched_bytes_count_against_the_request_total(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl, max_request_bytes=BIG + len(PNG) // 2)
    body = chat(img("data:image/png;base64," + base64.b64encode(PNG + bytes(BIG - len(PNG))).decode()), img(server.url("/cat.png")))
    refusal = run(policy, "chat", body)
    assert (refusal.reason, refusal.param) == ("media_request_too_large", "messages[0].content[2].image_url.url")


def test_walk_refusals_come_before_any_fetch(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    before = server.hits["/cat.png"]
    refusal = run(policy, "chat", chat(img(server.url("/cat.png")), img("https://evil.test/cat.png")))
    assert refusal.reason == "domain_not_allowed" and server.hits["/cat.png"] == before


def test_text_only_and_data_only_bodies_never_fetch(server: MediaServer, client_ssl: ssl.SSLContext):
    policy = inline_policy(server, client_ssl)
    hits = sum(server.hits.values())
    assert run(policy, "chat", chat_raw([{"role": "user", "content": "hi"}])) is None
    assert run(policy, "chat", chat(img(D_PNG_INLINE))) is None
    assert sum(server.hits.values()) == hits
