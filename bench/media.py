"""What the media policy costs per request, side by side with parsing the same body.

Rows: a text-only chat body (the fast path), the same as SDK-style text parts, one 1 MiB image as
a base64 PNG data URL, four https image URLs, and an Anthropic body with one 1 MiB base64 image.
Baselines from the same run: ``orjson.loads`` of the body, and the gateway's own strict parse
(``BodyPolicy.parse``: duplicate keys refused, depth bounded), which every request pays anyway.
The policy runs twice per row, with the magic-byte check off (the old default) and on (the
default since it decodes only the first bytes of each item), so its cost shows side by side.

With ``--fetch`` it also measures ``fetch: inline``: one request naming a 1 MiB PNG on a local
TLS server (throw-away CA from trustme, a test extra; loopback let through for the bench only),
fetched, sniffed and inlined, beside the same request sent with the image inline by the client.

    python bench/media.py [--repeat 7] [--quick] [--fetch]
"""

from __future__ import annotations

import argparse
import base64
import binascii
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import LimitsConfig  # noqa: E402
from gateway.config.media import MediaConfig  # noqa: E402
from gateway.filters import RequestContext  # noqa: E402
from gateway.filters.body import BodyPolicy  # noqa: E402
from gateway.filters.media import MediaPolicy  # noqa: E402
from gateway.media.signatures import SIGNATURES  # noqa: E402
from gateway.routes import ROUTES  # noqa: E402

MODEL = "bench-model"


def bodies() -> list[tuple[str, str, dict[str, Any]]]:
    png = b"\x89PNG\r\n\x1a\n" + os.urandom(1024 * 1024 - 8)
    image = "data:image/png;base64," + base64.b64encode(png).decode()
    conversation = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly and cite sources."},
        {"role": "user", "content": "What is the capital of France? " * 8},
        {"role": "assistant", "content": "Paris is the capital of France. " * 6},
        {"role": "user", "content": "And of Germany? Please explain the history in a few sentences."},
    ]
    text_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conversation]
    look = {"type": "text", "text": "What is in these images?"}
    urls = [{"type": "image_url", "image_url": {"url": f"https://images.example.com/photos/{i}/cat.jpg?w=1024&sig=ab%2Fcd{i}"}} for i in range(4)]
    return [
        ("text-only chat (4 messages)", "chat", {"model": MODEL, "messages": conversation, "max_tokens": 64}),
        ("text-only chat, text parts", "chat", {"model": MODEL, "messages": text_parts, "max_tokens": 64}),
        ("1 MiB base64 PNG (chat)", "chat", {"model": MODEL, "messages": [{"role": "user", "content": [look, {"type": "image_url", "image_url": {"url": image}}]}]}),
        ("4 https image URLs (chat)", "chat", {"model": MODEL, "messages": [{"role": "user", "content": [look, *urls]}]}),
        (
            "1 MiB base64 PNG (anthropic)",
            "messages",
            {
                "model": MODEL,
                "max_tokens": 64,
                "messages": [{"role": "user", "content": [look, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image.split(",", 1)[1]}}]}],
            },
        ),
    ]


def per_call(fn: Callable[[], Any], repeat: int, budget: float = 0.2) -> float:
    """Seconds per call: the best of ``repeat`` timed loops, each sized to about ``budget`` seconds."""
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed > budget / 4 or n >= 1 << 22:
            break
        n *= 4
    n = max(1, int(n * budget / max(elapsed, 1e-9) / 4))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def paired(a: Callable[[], Any], b: Callable[[], Any], repeat: int, budget: float) -> tuple[float, float]:
    """Seconds per call of ``a`` and ``b``, timed in alternating loops so machine noise hits both alike."""
    n = max(1, int(budget / max(per_call(a, 1, budget / 4), 1e-9) / 4))
    best_a = best_b = float("inf")
    for _ in range(repeat):
        for fn, which in ((a, "a"), (b, "b")):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t = (time.perf_counter() - t0) / n
            if which == "a":
                best_a = min(best_a, t)
            else:
                best_b = min(best_b, t)
    return best_a, best_b


def fmt(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:7.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:7.1f} µs"
    return f"{seconds * 1e3:7.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats of shorter loops")
    ap.add_argument("--fetch", action="store_true", help="also measure fetch: inline against a local TLS server")
    args = ap.parse_args()
    budget = 0.05 if args.quick else 0.2
    if args.quick:
        args.repeat = 3

    magic_off = MediaPolicy(MediaConfig(allowed_domains=("images.example.com",), check_magic=False))
    magic_on = MediaPolicy(MediaConfig(allowed_domains=("images.example.com",)))
    assert magic_on.cfg.check_magic, "the magic-byte check is on by default"
    parser = BodyPolicy(LimitsConfig())
    paths = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}

    print(f"media policy cost per request (best of {args.repeat}; Python {sys.version.split()[0]})")
    header = (
        f"{'body':32} {'size':>9}  {'orjson.loads':>12}  {'BodyPolicy.parse':>16}  {'magic off':>12}  {'magic on':>12}  "
        f"{'magic cost':>10}  {'policy/orjson':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, kind, body in bodies():
        raw = orjson.dumps(body)
        route = ROUTES[("POST", paths[kind])]
        ctx = RequestContext({}, route, {})
        ctx.body = orjson.loads(raw)
        for policy in (magic_off, magic_on):
            assert policy.check_body(ctx) is None, name  # every row passes; the body is not rewritten
        parse_ctx = RequestContext({}, route, {})

        t_json = per_call(lambda: orjson.loads(raw), args.repeat, budget)
        t_parse = per_call(lambda: parser.parse(parse_ctx, raw), args.repeat, budget)
        t_off, t_on = paired(lambda: magic_off.check_body(ctx), lambda: magic_on.check_body(ctx), args.repeat, budget)
        magic = f"{(t_on - t_off) / t_off:+9.1%}" if "base64" in name else "no base64"
        size = f"{len(raw) / 1024:.1f} KiB" if len(raw) < 1 << 20 else f"{len(raw) / (1 << 20):.2f} MiB"
        print(
            f"{name:32} {size:>9}  {fmt(t_json):>12}  {fmt(t_parse):>16}  {fmt(t_off):>12}  {fmt(t_on):>12}  "
            f"{magic:>10}  {t_on / t_json:12.2f}x"
        )
    magic_alone(args.repeat, budget)
    if args.fetch:
        inline_fetch(args.repeat, 5 if args.quick else 20)


def inline_fetch(repeat: int, n: int) -> None:
    """Per-request cost of fetch: inline for one 1 MiB image, beside the client sending it inline."""
    import asyncio
    import http.server
    import ssl
    import threading

    import trustme

    from gateway.media.addresses import is_global_address
    from gateway.media.fetch import MediaFetcher

    png = b"\x89PNG\r\n\x1a\n" + os.urandom(1024 * 1024 - 8)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("media.bench").configure_cert(server_ctx)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)

        async def resolve(host: str, p: int) -> list[str]:
            return ["127.0.0.1"]

        fetcher = MediaFetcher(resolver=resolve, ssl_context=client_ctx, address_allowed=lambda a: a == "127.0.0.1" or is_global_address(a))
        inline = MediaPolicy(MediaConfig(allowed_domains=(f"media.bench:{port}",), fetch="inline"), fetcher=fetcher)
        plain = MediaPolicy(MediaConfig(allowed_domains=(f"media.bench:{port}",)))
        route = ROUTES[("POST", "/v1/chat/completions")]
        by_url = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"https://media.bench:{port}/cat.png"}}]}]}
        by_data = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}]}]}

        async def timed(policy: MediaPolicy, body: dict[str, Any]) -> float:
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                for _ in range(n):
                    ctx = RequestContext({}, route, {})
                    ctx.body = orjson.loads(orjson.dumps(body))
                    assert await policy.check_body_async(ctx) is None
                best = min(best, (time.perf_counter() - t0) / n)
            return best

        async def both() -> tuple[float, float]:
            return await timed(plain, by_data), await timed(inline, by_url)

        t_data, t_fetch = asyncio.run(both())
        print(f"\nfetch: inline, one 1 MiB PNG per request (best of {repeat} x {n}; includes copying the body):")
        print(f"  client sends it inline (data: URL, checked)          {fmt(t_data):>12}")
        print(f"  gateway fetches it (TLS on loopback, sniff, base64)  {fmt(t_fetch):>12}")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def magic_alone(repeat: int, budget: float) -> None:
    """The check by itself, free of the walk's noise: decode the first 24 base64 characters, compare a prefix."""
    png = b"\x89PNG\r\n\x1a\n" + os.urandom(1024 * 1024 - 8)
    payload = base64.b64encode(png).decode()
    check = SIGNATURES[("image", "image/png")]
    t = per_call(lambda: check(binascii.a2b_base64(payload[:24])), repeat, budget)
    print(f"\nthe magic check alone on a 1 MiB PNG (decode 24 base64 chars, compare the signature): {fmt(t).strip()} per item")


if __name__ == "__main__":
    main()
