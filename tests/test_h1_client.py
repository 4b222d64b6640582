"""The native HTTP/1.1 client on its own: keep-alive reuse, back-pressure, TLS, a lost connection."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import threading

import pytest
import uvicorn

from gateway.config import TimeoutsConfig
from gateway.upstream import NativeUpstream, UpstreamFailure
from support import free_port, wait_until

pytestmark = pytest.mark.e2e


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/big":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(200):
            await send({"type": "http.response.body", "body": b"data: " + b"x" * 16384 + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    out = b'{"echo": ' + str(len(body)).encode() + b', "client": "' + f"{scope['client'][1]}".encode() + b'"}'
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module", params=["http", "https"])
def server(request, tmp_path_factory):
    port = free_port()
    kw = {}
    ctx = None
    if request.param == "https":
        d = tmp_path_factory.mktemp("tls")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                       check=True, capture_output=True)
        kw = {"ssl_keyfile": str(d / "key.pem"), "ssl_certfile": str(d / "cert.pem")}
        ctx = ssl.create_default_context(cafile=str(d / "cert.pem"))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", **kw))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    wait_until(lambda: srv.started, 10, what="tls server")
    yield f"{request.param}://127.0.0.1:{port}", ctx
    srv.should_exit = True
    t.join(10)


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_connection_is_reused(server):
    base, ctx = server

    async def go():
        up = NativeUpstream(TimeoutsConfig())
        up._tls = ctx
        ports = []
        for _ in range(3):
            r = await up.open(base + "/v1/chat/completions", b'{"a": 1}', [])
            body = await up.read_all(r)
            await r.aclose()
            ports.append(body.split(b'"client": "')[1].split(b'"')[0])
        await up.aclose()
        return r.status, ports

    status, ports = run(go())
    assert status == 200 and len(set(ports)) == 1  # one connection for all three


def test_a_large_stream_arrives_whole_with_a_slow_consumer(server):
    base, ctx = server

    async def go():
        up = NativeUpstream(TimeoutsConfig())
        up._tls = ctx
        r = await up.open(base + "/big", b"{}", [])
        total = 0
        conn = r._close.__self__._conn
        # The server runs ahead: past the high-water mark reading pauses (a bounded wait for that).
        deadline = asyncio.get_running_loop().time() + 10
        while not conn._paused and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        paused_at_peak = conn._paused and conn.buffered > (1 << 20)
        async for chunk in r.chunks():
            total += len(chunk)
            await asyncio.sleep(0.001)  # slower than the server: reading pauses, nothing is lost
        await r.aclose()
        await up.aclose()
        return total, paused_at_peak

    total, paused = run(go())
    assert total == 200 * (16384 + 8)
    assert paused


def test_connection_refused_is_a_connect_failure():
    async def go():
        up = NativeUpstream(TimeoutsConfig())
        with pytest.raises(UpstreamFailure) as exc:
            await up.open(f"http://127.0.0.1:{free_port()}/v1/chat/completions", b"{}", [])
        await up.aclose()
        return exc.value.kind

    assert run(go()) == "connect_refused"


# -- an untrusted backend: the client's own checks, against a raw socket server in the same loop ---------
async def raw_backend(answer: bytes):
    """Answers every request on a connection with ``answer``; returns (server, url, connection count)."""
    seen = {"connections": 0}

    async def serve(reader, writer):
        seen["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/chat/completions", seen


def ok(body: bytes = b'{"ok": 1}') -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def fetch(up: NativeUpstream, url: str) -> bytes:
    r = await up.open(url, b"{}", [])
    try:
        return await up.read_all(r)
    finally:
        await r.aclose()


@pytest.mark.parametrize(
    "answer, reason",
    [
        (b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + ok(), "status_103"),
        (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n", "status_101"),
        (b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-%d: v\r\n" % i for i in range(20)) + b"content-length: 0\r\n\r\n", "too_many_headers"),
        (b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 5000 + b"\r\ncontent-length: 0\r\n\r\n", "headers_too_large"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n{}", "body_too_large"),
        # no length declared, the whole body in one read (read_all's no-generator path): still capped
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7d0\r\n" + b"a" * 2000 + b"\r\n0\r\n\r\n", "body_too_large"),
    ],
)
def test_what_the_client_refuses_and_why(answer, reason):
    from gateway.config import UpstreamConfig
    from gateway.upstream import UpstreamInvalid

    async def go():
        srv, url, seen = await raw_backend(answer)
        up = NativeUpstream(TimeoutsConfig(first_byte=5), UpstreamConfig(max_header_bytes=4096, max_headers=16, max_response_bytes=1024))
        try:
            with pytest.raises(UpstreamInvalid) as exc:
                await fetch(up, url)
            assert not any(p.idle for p in up._pools.values()), "a connection that broke the rules is never reused"
            return exc.value.reason
        finally:
            await up.aclose()
            srv.close()
            await srv.wait_closed()

    assert run(go()) == reason


def test_100_continue_is_skipped_and_the_connection_kept():
    async def go():
        srv, url, seen = await raw_backend(b"HTTP/1.1 100 Continue\r\n\r\n" + ok())
        up = NativeUpstream(TimeoutsConfig(first_byte=5))
        try:
            bodies = [await fetch(up, url), await fetch(up, url)]
            return bodies, seen["connections"]
        finally:
            await up.aclose()
            srv.close()
            await srv.wait_closed()

    assert run(go()) == ([b'{"ok": 1}', b'{"ok": 1}'], 1)


def test_a_second_response_in_the_same_packet_is_dropped_with_the_connection():
    async def go():
        srv, url, seen = await raw_backend(ok() + ok(b'{"injected": 1}'))
        up = NativeUpstream(TimeoutsConfig(first_byte=5))
        try:
            bodies = [await fetch(up, url), await fetch(up, url)]
            return bodies, seen["connections"]
        finally:
            await up.aclose()
            srv.close()
            await srv.wait_closed()

    assert run(go()) == ([b'{"ok": 1}', b'{"ok": 1}'], 2)  # the second request had to open a new connection


def test_each_request_on_a_kept_connection_gets_its_own_deadlines():
    """One timer per connection outlives its requests and re-arms itself (h1 ``_Conn.time``): a
    request on a reused connection still times out at its own first-byte deadline, and a body that
    stops mid-way at its idle one, whatever the earlier requests armed."""
    from gateway.upstream import UpstreamTimeout

    answers = [ok(), ok(), b"slow", b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n{\"a\""]

    async def serve(reader, writer):
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                answer = answers.pop(0)
                if answer != b"slow":  # slow: no answer at all
                    writer.write(answer)
                    await writer.drain()
            await asyncio.sleep(10)  # the last body never ends
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go():
        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/chat/completions"
        loop = asyncio.get_running_loop()
        up = NativeUpstream(TimeoutsConfig(first_byte=0.5, idle=0.3))
        try:
            bodies = [await fetch(up, url), await fetch(up, url)]
            await asyncio.sleep(0.3)  # a later deadline than the handle armed for the first request
            started = loop.time()
            with pytest.raises(UpstreamTimeout) as first_byte:
                await fetch(up, url)
            waited = loop.time() - started
            r = await up.open(url, b"{}", [])  # a new connection: the timed-out one is closed
            started = loop.time()
            with pytest.raises(UpstreamTimeout) as idle:
                await up.read_all(r)
            idle_waited = loop.time() - started
            await r.aclose()
            return bodies, first_byte.value.phase, waited, idle.value.phase, idle_waited
        finally:
            await up.aclose()
            srv.close()

    bodies, phase, waited, idle_phase, idle_waited = run(go())
    assert bodies == [b'{"ok": 1}', b'{"ok": 1}']
    assert phase == "first_byte" and 0.45 <= waited < 3
    assert idle_phase == "idle" and 0.25 <= idle_waited < 3
