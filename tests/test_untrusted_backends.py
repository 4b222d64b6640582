"""Backends are untrusted: a deliberately broken backend (a raw asyncio socket server) against a
real gateway.

Each misbehaviour has a defined answer: a body over the cap, a 101 or another 1xx, an oversized
head, a lying Content-Length and a stream that never ends a line are 502s (or an error event once a
stream started); bytes after a complete response close that connection and never reach a client;
a 5xx body is replaced by our own error with the same status.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable

import httpx
import pytest

from support import GatewayServer, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
CAP = 1 << 20  # upstream.max_response_bytes in these tests
LINE_CAP = 64 * 1024
HUGE = 300 * 1024 * 1024

Behaviour = Callable[["BrokenBackend", asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


def response(body: bytes, status: str = "200 OK", ctype: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: " + str(len(body)).encode()
        + b"\r\n" + extra + b"\r\n" + body
    )


def ok(n: int) -> bytes:
    return response(b'{"id": "genuine-%d", "object": "chat.completion", "choices": []}' % n)



class BrokenBackend:
    """Answers GET /health and /v1/models properly, and each POST as ``behaviour`` says.

    Runs its own event loop in a thread. Counts connections and POSTs, the bytes a behaviour wrote,
    and sets ``closed_by_peer`` when the gateway closes a connection that served a POST.
    """

    def __init__(self) -> None:
        self.behaviour: Behaviour = normal
        self.connections = 0
        self.posts = 0
        self.base = 0
        self.written = 0
        self.closed_by_peer = threading.Event()
        self.writer_done = threading.Event()
        self.client_answered = threading.Event()  # set by a test once its client holds the answer
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self._server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="broken-backend", daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def reset(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.base = self.posts  # behaviours count POSTs from here: n == 1 is the first since reset
        self.written = 0
        self.closed_by_peer.clear()
        self.writer_done.clear()
        self.client_answered.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served_post = False
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    if served_post:
                        self.closed_by_peer.set()
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                if head.startswith(b"GET /health"):
                    writer.write(response(b'{"status": "healthy"}'))
                elif head.startswith(b"GET "):
                    writer.write(response(b'{"object": "list", "data": [{"id": "%s"}]}' % MODEL.encode()))
                else:
                    self.posts += 1
                    served_post = True
                    if not await self.behaviour(self, reader, writer, self.posts - self.base):
                        return
                await writer.drain()
        except ConnectionError:
            if served_post:
                self.closed_by_peer.set()
        finally:
            writer.close()

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- behaviours: return True to keep serving the connection ---------------------------------------
async def normal(b, reader, writer, n) -> bool:
    writer.write(ok(n))
    return True


async def huge_unsized(b, reader, writer, n) -> bool:
    """300 MB with no Content-Length (ends with the connection): only the read cap can stop it."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
    block = b"x" * (1 << 20)
    try:
        while b.written < HUGE:
            writer.write(block)
            b.written += len(block)
            await writer.drain()
    except ConnectionError:
        b.closed_by_peer.set()
    finally:
        b.writer_done.set()
    return False


async def huge_declared(b, reader, writer, n) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % HUGE)
    await writer.drain()
    await reader.read(1)  # until the gateway hangs up
    b.closed_by_peer.set()
    return False


async def pipelined_extra(b, reader, writer, n) -> bool:
    """A genuine answer and, in the same write, a second response nobody asked for."""
    if n == 1:
        writer.write(ok(n) + response(b'{"id": "EVIL-injected"}'))
    else:
        writer.write(ok(n))
    return True


async def late_extra(b, reader, writer, n) -> bool:
    """The unsolicited response arrives after the genuine one was delivered (on an idle connection)."""
    writer.write(ok(n))
    if n == 1:
        await writer.drain()
        # Once the client holds answer 1, the gateway has pooled this connection: now it is idle.
        await asyncio.to_thread(b.client_answered.wait, 10)
        writer.write(response(b'{"id": "EVIL-injected"}'))
    return True


async def switching_protocols(b, reader, writer, n) -> bool:
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\r\nEVIL-frames")
    await writer.drain()
    await reader.read(1)
    b.closed_by_peer.set()
    return False


async def processing_then_final(b, reader, writer, n) -> bool:
    writer.write(b"HTTP/1.1 102 Processing\r\n\r\n" + ok(n))
    return True


async def continue_then_final(b, reader, writer, n) -> bool:
    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(n))
    return True


TRACEBACK = (
    b'Traceback (most recent call last):\n  File "/srv/engine/lmdeploy/serve/openai/api_server.py", line 412\n'
    b"ConnectionError: cannot reach kv store at 10.20.30.40:6379\x1b[2J\n"
)


async def server_error(b, reader, writer, n) -> bool:
    writer.write(response(TRACEBACK, "500 Internal Server Error", b"text/plain"))
    return True


async def overloaded(b, reader, writer, n) -> bool:
    writer.write(response(b"busy at 10.20.30.40", "503 Service Unavailable", b"text/plain", b"retry-after: 7\r\n"))
    return True


async def many_headers(b, reader, writer, n) -> bool:
    extra = b"".join(b"x-h%d: v\r\n" % i for i in range(500))
    writer.write(response(b"{}", extra=extra))
    return True


async def huge_header(b, reader, writer, n) -> bool:
    writer.write(response(b"{}", extra=b"x-big: " + b"a" * 200_000 + b"\r\n"))
    return True


async def short_body_then_close(b, reader, writer, n) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"id\": 1}")
    return False


async def long_body_for_length(b, reader, writer, n) -> bool:
    """Content-Length says 10; 40 bytes follow: the rest must not reach anyone."""
    if n == 1:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n" + b'{"a": 123}EVIL-tail-bytes-of-the-backend')
    else:
        writer.write(ok(n))
    return True


async def endless_line(b, reader, writer, n) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    block = b"x" * 8192
    try:
        writer.write(b"%x\r\ndata: {}\n\n\r\n" % len(b"data: {}\n\n"))
        while b.written < HUGE:
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            b.written += len(block)
            await writer.drain()
    except ConnectionError:
        b.closed_by_peer.set()
    finally:
        b.writer_done.set()
    return False


async def endless_event(b, reader, writer, n) -> bool:
    """Short lines forever, never the blank line that ends an SSE event."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    block = b"data: " + b"y" * 1000 + b"\n"
    try:
        while b.written < HUGE:
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            b.written += len(block)
            await writer.drain()
    except ConnectionError:
        b.closed_by_peer.set()
    finally:
        b.writer_done.set()
    return False


async def length_and_chunked(b, reader, writer, n) -> bool:
    """Both framings at once: which one a parser believes decides where the next response starts."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"2\r\n{}\r\n0\r\n\r\n")  # fmt: skip
    return True


# -- the gateway in front of it ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend():
    b = BrokenBackend()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def gw(keys, backend):
    cfg = gateway_config(
        keys,
        [{"url": backend.url, "name": "broken", "models": [MODEL]}],
        upstream={"max_response_bytes": CAP, "max_line_bytes": LINE_CAP, "max_header_bytes": 16384},
        balancer={"retries": 0},
        timeouts={"first_byte": 5, "idle": 2},
        health={"interval": 0.2, "timeout": 1.0, "failures_to_eject": 1000},
    )
    with GatewayServer(cfg) as server:
        server.keys = keys
        yield server


def post(gw, path: str = "/v1/chat/completions", **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    if path == "/v1/messages":
        body["max_tokens"] = 8
    return httpx.post(gw.url + path, headers={"authorization": f"Bearer {gw.keys.alice}"}, json=body, timeout=30)


def test_a_300_mb_body_without_length_is_cut_at_the_cap(gw, backend):
    backend.reset(huge_unsized)
    r = post(gw)
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
    assert "larger than" in r.json()["error"]["message"]
    assert backend.writer_done.wait(30) and backend.closed_by_peer.is_set()
    # The gateway stopped reading near the cap; socket buffers hold a few MB at most.
    assert backend.written < 64 * CAP


def test_a_declared_300_mb_body_is_refused_without_reading(gw, backend):
    backend.reset(huge_declared)
    r = post(gw, "/v1/messages")
    assert r.status_code == 502 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert backend.closed_by_peer.wait(10)


def test_an_extra_pipelined_response_never_reaches_a_client(gw, backend):
    backend.reset(pipelined_extra)
    r1 = post(gw)
    r2 = post(gw)
    assert r1.status_code == 200 and r1.json()["id"] == "genuine-1"
    assert r2.status_code == 200 and r2.json()["id"] == "genuine-2"
    assert b"EVIL" not in r1.content + r2.content
    assert backend.closed_by_peer.wait(10)  # the poisoned connection was closed, not reused


def test_an_unsolicited_response_on_an_idle_connection_poisons_it(gw, backend):
    backend.reset(late_extra)
    r1 = post(gw)
    assert r1.status_code == 200 and r1.json()["id"] == "genuine-1"
    backend.client_answered.set()
    assert backend.closed_by_peer.wait(10)  # closed the moment the bytes arrived
    r2 = post(gw)
    assert r2.status_code == 200 and r2.json()["id"] == "genuine-2"


def test_101_is_refused_as_502(gw, backend):
    backend.reset(switching_protocols)
    r = post(gw)
    assert r.status_code == 502 and b"EVIL" not in r.content
    assert backend.closed_by_peer.wait(10)


def test_an_interim_1xx_is_never_relayed(gw, backend):
    backend.reset(processing_then_final)
    r = post(gw)
    assert r.status_code == 502 and r.json()["error"]["message"] == "The backend sent an invalid response."


def test_100_continue_is_skipped(gw, backend):
    backend.reset(continue_then_final)
    r = post(gw)
    assert r.status_code == 200 and r.json()["id"].startswith("genuine-")


def test_a_5xx_body_is_replaced_and_logged_escaped(gw, backend, caplog):
    backend.reset(server_error)
    with caplog.at_level(logging.WARNING, logger="gateway.router"):
        r = post(gw)
        a = post(gw, "/v1/messages")
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "The backend failed to answer (HTTP 500).", "type": "server_error", "param": None, "code": "upstream_error"}
    assert a.status_code == 500 and a.json() == {"type": "error", "error": {"type": "api_error", "message": "The backend failed to answer (HTTP 500)."}}
    for leaked in (b"Traceback", b"10.20.30.40", b"/srv/engine"):
        assert leaked not in r.content + a.content
    logged = [rec.getMessage() for rec in caplog.records if "answered 500" in rec.getMessage()]
    assert logged and "10.20.30.40" in logged[0] and "\x1b" not in logged[0] and "\\x1b" in logged[0]


def test_a_503_keeps_its_status_and_retry_after_only(gw, backend):
    backend.reset(overloaded)
    r = post(gw)
    assert r.status_code == 503 and r.headers.get("retry-after") == "7" and b"10.20.30.40" not in r.content


def test_too_many_response_headers_are_refused(gw, backend):
    backend.reset(many_headers)
    r = post(gw)
    assert r.status_code == 502


def test_an_oversized_response_header_is_refused(gw, backend):
    backend.reset(huge_header)
    r = post(gw)
    assert r.status_code == 502 and b"aaaa" not in r.content


def test_a_content_length_longer_than_the_body_is_a_502(gw, backend):
    backend.reset(short_body_then_close)
    r = post(gw)
    assert r.status_code == 502 and b'"id": 1' not in r.content


def test_bytes_beyond_content_length_are_cut_and_the_connection_dropped(gw, backend):
    backend.reset(long_body_for_length)
    r1 = post(gw)
    assert r1.status_code == 200 and r1.content == b'{"a": 123}'
    assert backend.closed_by_peer.wait(10)
    r2 = post(gw)
    assert r2.status_code == 200 and r2.json()["id"] == "genuine-2" and b"EVIL" not in r2.content


def test_a_stream_that_never_ends_a_line_is_cut_with_an_error_event(gw, backend):
    backend.reset(endless_line)
    r = post(gw, stream=True)
    assert r.status_code == 200
    assert r.content.endswith(b"\n\n") and b"upstream_stream_error" in r.content
    assert len(r.content) < 16 * LINE_CAP
    assert backend.writer_done.wait(30) and backend.closed_by_peer.is_set()
    assert backend.written < 64 * CAP


def test_a_stream_event_that_never_ends_is_cut_with_an_error_event(gw, backend):
    backend.reset(endless_event)
    r = post(gw, stream=True)
    assert r.status_code == 200 and b"upstream_stream_error" in r.content
    assert len(r.content) < 16 * LINE_CAP
    assert backend.writer_done.wait(30) and backend.closed_by_peer.is_set()


def test_content_length_with_chunked_is_refused(gw, backend):
    backend.reset(length_and_chunked)
    r = post(gw)
    assert r.status_code == 502


def test_the_gateway_still_answers_after_all_of_it(gw, backend):
    backend.reset(normal)
    wait_until(lambda: post(gw).status_code == 200, 10, what="a normal answer")
