"""Hostile clients on raw sockets against a real `gateway serve` process (issue 8, items 1 and 2).

Each attack asserts the defined answer, that the gateway stayed responsive (one `/health`
request, no retry, answered within 100 ms while the attack is on) and that it stayed bounded
(its RSS, read from /proc, under a bound). The gateway runs with an open-files limit of 256, so
its connection cap is (256 - 64) / 2 = 96, and with short timeouts so the tests are quick.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import orjson
import pytest

from support import ROOT, Sim, free_port, wait_until

pytestmark = pytest.mark.e2e

NOFILE = 256
CAP = (NOFILE - 64) // 2
LINGER_BYTES = 48 << 20
MIB = 1 << 20


class Gateway:
    def __init__(self, port: int, proc: subprocess.Popen, log: Path):
        self.port, self.proc, self.log = port, proc, log

    def status(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def rss(self) -> int:
        return self.status("VmRSS")

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def connect(self, timeout: float = 5.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def health_ms(self) -> float:
        """One /health request on a new connection, no retry: milliseconds to the whole answer."""
        started = time.perf_counter()
        with self.connect(timeout=2.0) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
            reply = read_all(s)
        elapsed = (time.perf_counter() - started) * 1000
        assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b'{"status":"ok"}'), reply[:200]
        return elapsed

    def assert_responsive(self) -> None:
        ms = self.health_ms()
        assert ms < 100, f"/health took {ms:.0f} ms during the attack"
        assert self.proc.poll() is None


def read_all(s: socket.socket, limit: int = 1 << 20) -> bytes:
    """Everything until the peer closes (a reset after data counts as the end)."""
    out = b""
    with contextlib.suppress(ConnectionResetError, socket.timeout):
        while len(out) < limit:
            data = s.recv(65536)
            if not data:
                break
            out += data
    return out


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    return int(reply[9:12])


def error_code(reply: bytes) -> str:
    """The error code of the first response in reply."""
    head, _, rest = reply.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    return orjson.loads(rest[:length])["error"]["code"]


class Sender(threading.Thread):
    """Writes a payload in a thread while the test reads the answer; records how far it got."""

    def __init__(self, sock: socket.socket, payload: bytes | Iterator[bytes]):
        super().__init__(daemon=True)
        self.sock, self.payload = sock, payload
        self.sent = 0
        self.error: Exception | None = None

    def run(self) -> None:
        chunks = [self.payload] if isinstance(self.payload, bytes) else self.payload
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    n = self.sock.send(view[: 1 << 20])
                    self.sent += n
                    view = view[n:]
        except OSError as exc:
            self.error = exc


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with Sim("test-model", api_key="backend-secret") as s:
        yield s


@pytest.fixture(scope="module")
def gw(keys, sim, tmp_path_factory) -> Iterator[Gateway]:
    port = free_port()
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = {
        "server": {
            "port": port, "log_level": "warning", "header_timeout": 1.0, "body_timeout": 2.0,
            "keepalive_timeout": 1.0, "linger_timeout": 2.0, "linger_bytes": LINGER_BYTES,
        },
        "auth": {"keys": keys.entries},
        "backends": [{"url": sim.url, "api_key": "backend-secret", "models": ["test-model"]}],
        "health": {"interval": 1.0},
    }
    (tmp / "gw.json").write_bytes(orjson.dumps(cfg))  # JSON is YAML
    log = tmp / "gw.log"

    def low_file_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(tmp / "gw.json")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=low_file_limit, start_new_session=True,
        )
    g = Gateway(port, proc, log)
    try:
        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                g.health_ms()
                return True
            except (OSError, AssertionError):
                return False

        wait_until(up, 30, 0.05, "gateway serve")
        yield g
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert "Too many open files" not in log.read_text()


def post_head(key: str, length: int | None, path: bytes = b"/v1/chat/completions", extra: bytes = b"") -> bytes:
    head = b"POST " + path + b" HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + key.encode() + b"\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += b"Content-Length: %d\r\n" % length
    return head + extra + b"\r\n"


def bounded(gw: Gateway, before: int, extra: int = 64 * MIB) -> None:
    rss = gw.rss()
    assert rss < before + extra, f"RSS grew from {before >> 20} to {rss >> 20} MiB"


# -- heads ---------------------------------------------------------------------------------------

def test_40000_repeated_header_lines_get_431_at_once(gw):
    rss, cpu = gw.rss(), gw.cpu()
    payload = b"GET /health HTTP/1.1\r\nHost: gw\r\n" + (b"X-A: " + b"a" * 200 + b"\r\n") * 40000 + b"\r\n"
    assert len(payload) > 8_000_000
    with gw.connect() as s:
        sender = Sender(s, payload)
        sender.start()
        gw.assert_responsive()
        reply = read_all(s)
        sender.join(10)
    assert status_of(reply) == 431 and error_code(reply) == "headers_too_large"
    assert sender.sent < len(payload), "the whole 8 MB head was read"
    gw.assert_responsive()
    assert gw.cpu() - cpu < 1.0
    bounded(gw, rss)


def test_many_short_repeated_headers_within_the_size_get_431_for_their_count(gw):
    payload = b"GET /health HTTP/1.1\r\nHost: gw\r\n" + b"X-A: 1\r\n" * 2000 + b"\r\n"  # 16 KB: under the size limit
    with gw.connect() as s:
        s.sendall(payload)
        reply = read_all(s)
    assert status_of(reply) == 431 and error_code(reply) == "too_many_headers"
    gw.assert_responsive()


@pytest.mark.parametrize("where", ["header", "url"])
def test_64_mb_header_value_or_url_is_cut_off_at_the_limit(gw, where):
    rss, cpu = gw.rss(), gw.cpu()
    big = b"a" * (64 * MIB)
    if where == "url":
        payload = [b"GET /health?x=", big, b" HTTP/1.1\r\nHost: gw\r\n\r\n"]
        expected = (414, "request_line_too_long")
    else:
        payload = [b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Big: ", big, b"\r\n\r\n"]
        expected = (431, "headers_too_large")
    with gw.connect() as s:
        sender = Sender(s, iter(payload))
        sender.start()
        gw.assert_responsive()
        reply = read_all(s)
        sender.join(10)
    assert (status_of(reply), error_code(reply)) == expected
    assert sender.error is not None and sender.sent < 32 * MIB, f"{sender.sent} bytes were taken"
    assert gw.cpu() - cpu < 1.0
    bounded(gw, rss)


def test_slowloris_headers_time_out_with_408(gw):
    socks = []
    try:
        for _ in range(40):
            s = gw.connect()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n")
            socks.append(s)
        started = time.monotonic()
        for i in range(3):  # a byte every 0.4 s keeps every read short of the header deadline
            for s in socks:
                s.sendall(b"X-%d: 1\r\n" % i)
            gw.assert_responsive()
            time.sleep(0.4)
        replies = [read_all(s) for s in socks]
        assert time.monotonic() - started < 5
    finally:
        for s in socks:
            s.close()
    for reply in replies:
        assert status_of(reply) == 408 and error_code(reply) == "header_timeout"
    gw.assert_responsive()


def test_keep_alive_and_header_deadlines_hold_across_a_reused_connection(gw):
    # The keep-alive, header and body deadlines share one timer handle that re-arms itself when a
    # request moved the deadline: the idle close and the 408 must still come, each from its own
    # deadline (1 s each in this fixture), counted from the right moment.
    with gw.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        sent = time.monotonic()
        assert status_of(s.recv(65536)) == 200
        assert read_all(s) == b""  # the server closed the idle connection
        assert 0.9 <= time.monotonic() - sent < 3.0
    with gw.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert status_of(s.recv(65536)) == 200
        time.sleep(0.5)  # within the keep-alive deadline; a head begins, and never ends
        s.sendall(b"GET /health HTTP/1.1\r\n")
        begun = time.monotonic()
        reply = read_all(s)
        assert status_of(reply) == 408 and error_code(reply) == "header_timeout"
        assert 0.9 <= time.monotonic() - begun < 3.0


# -- bodies --------------------------------------------------------------------------------------

def test_slow_body_times_out_with_408(gw, keys, sim):
    sim.clear()
    with gw.connect() as s:
        s.sendall(post_head(keys.alice, 1000) + b'{"model": "test-model", ')
        started = time.monotonic()
        gw.assert_responsive()
        with contextlib.suppress(OSError):
            for _ in range(20):
                s.sendall(b" ")
                time.sleep(0.25)
        reply = read_all(s)
    assert status_of(reply) == 408 and error_code(reply) == "body_timeout"
    assert time.monotonic() - started < 4
    assert sim.requests() == []


def test_whole_body_first_then_read_gets_413_not_a_reset(gw, keys):
    rss = gw.rss()
    body = b" " * (40 * MIB)  # over the 32 MiB body limit
    with gw.connect(timeout=20) as s:
        s.sendall(post_head(keys.alice, len(body)) + body)  # all of it before reading a byte
        reply = read_all(s)
    assert status_of(reply) == 413 and b"connection: close" in reply.lower()
    gw.assert_responsive()
    bounded(gw, rss)


def test_whole_body_first_then_read_gets_401_not_a_reset(gw):
    body = orjson.dumps({"model": "test-model", "messages": [{"role": "user", "content": "x" * (4 * MIB)}]})
    with gw.connect(timeout=20) as s:
        s.sendall(post_head("sk-not-a-key", len(body)) + body)
        reply = read_all(s)
    assert status_of(reply) == 401
    gw.assert_responsive()


def test_health_with_an_endless_chunked_body_does_not_take_gigabytes(gw):
    rss = gw.rss()

    def chunks() -> Iterator[bytes]:
        piece = b"%x\r\n%s\r\n" % (MIB, b"z" * MIB)
        for _ in range(4096):  # 4 GiB if nobody stops it
            yield piece

    with gw.connect(timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
        sender = Sender(s, chunks())
        sender.start()
        reply = read_all(s)
        sender.join(15)
    assert status_of(reply) == 200 and b"connection: close" in reply.lower()
    assert not sender.is_alive() and sender.error is not None
    assert sender.sent < LINGER_BYTES + 32 * MIB, f"{sender.sent >> 20} MiB taken"
    gw.assert_responsive()
    bounded(gw, rss)


def test_32_mb_body_of_small_objects_costs_little_cpu_and_memory(gw, keys, sim):
    sim.clear()
    message = {"role": "user", "content": "hi"}
    raw = orjson.dumps({"model": "test-model", "messages": [message] * 1_100_000})
    raw = raw[: 32 * MIB - 64]
    raw = raw[: raw.rfind(b"},") + 1] + b'], "model": "test-model"}'  # and a duplicate key at the very end
    rss, cpu = gw.rss(), gw.cpu()
    with gw.connect(timeout=30) as s:
        sender = Sender(s, post_head(keys.alice, len(raw)) + raw)
        sender.start()
        reply = read_all(s)
        sender.join(10)
        gw.assert_responsive()
    assert status_of(reply) == 400 and error_code(reply) == "invalid_request_body"
    assert orjson.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("Request body has more than")
    used = gw.cpu() - cpu
    assert used < 2.0, f"{used:.1f} s of CPU for one body"
    bounded(gw, rss, extra=4 * len(raw))
    assert sim.requests() == []


def test_32_mb_body_under_the_value_cap_with_a_late_duplicate_key_is_bounded(gw, keys, sim):
    sim.clear()
    message = {"role": "user", "content": "hello there, " * 30}  # ~80k objects: under the default value cap
    raw = orjson.dumps({"model": "test-model", "messages": [message] * 80_000})
    raw = raw[: 32 * MIB - 64]
    raw = raw[: raw.rfind(b"},") + 1] + b'], "model": "test-model"}'
    t = time.process_time()
    orjson.loads(raw)
    loads_cpu = time.process_time() - t
    rss, cpu = gw.rss(), gw.cpu()
    with gw.connect(timeout=30) as s:
        sender = Sender(s, post_head(keys.alice, len(raw)) + raw)
        sender.start()
        reply = read_all(s)
        sender.join(10)
    gw.assert_responsive()
    assert status_of(reply) == 400 and error_code(reply) == "invalid_request_body"
    assert b"Duplicate key" in reply
    used = gw.cpu() - cpu
    assert used < 4 * loads_cpu + 1.0, f"{used:.1f} s of CPU; orjson.loads alone takes {loads_cpu:.1f} s"
    bounded(gw, rss, extra=12 * len(raw))
    assert sim.requests() == []


# -- no upgrades, no desync ------------------------------------------------------------------------

def test_h2c_upgrade_with_a_late_body_is_one_request_and_one_answer(gw, keys, sim):
    sim.clear()
    smuggled = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
    head = post_head(keys.alice, len(smuggled), extra=b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n")
    with gw.connect() as s:
        s.sendall(head)
        time.sleep(0.05)  # the body in a later packet
        with contextlib.suppress(OSError):
            s.sendall(smuggled)
        reply = read_all(s)
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    assert status_of(reply) == 400 and error_code(reply) == "upgrade_not_supported"
    assert sim.requests() == []
    gw.assert_responsive()


def test_upgrade_header_without_connection_upgrade_is_framed_by_length(gw, keys, sim):
    sim.clear()
    smuggled = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
    with gw.connect() as s:
        s.sendall(post_head(keys.alice, len(smuggled), extra=b"Upgrade: h2c\r\n"))
        time.sleep(0.05)
        s.sendall(smuggled + b"GET /nope HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        reply = read_all(s)
    # The smuggled bytes are the POST's (invalid JSON) body; the next request is the one after it.
    assert reply.count(b"HTTP/1.1 ") == 2, reply
    assert status_of(reply) == 400 and error_code(reply) == "invalid_request_body"
    assert b"HTTP/1.1 404 " in reply and b'"status":"ok"' not in reply
    assert sim.requests() == []


def test_websocket_upgrade_is_refused(gw):
    with gw.connect() as s:
        s.sendall(
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        reply = read_all(s)
    assert status_of(reply) == 400 and error_code(reply) == "upgrade_not_supported"
    assert reply.count(b"HTTP/1.1 ") == 1
    gw.assert_responsive()


# -- connections ---------------------------------------------------------------------------------

def test_idle_flood_is_shed_and_closed_while_new_requests_are_served(gw):
    socks: list[socket.socket] = []
    try:
        for _ in range(CAP + 60):  # idle connections past the cap: connect, send nothing
            socks.append(gw.connect())
        served = 0
        for _ in range(20):
            gw.assert_responsive()
            served += 1
        assert gw.fds() < NOFILE - 32, "the gateway holds more files than its headroom allows"
        # Every idle one is closed: the oldest to make room, the rest after the keep-alive timeout.
        for s in socks:
            s.settimeout(5.0)
            assert read_all(s) == b""
    finally:
        for s in socks:
            s.close()
    assert served == 20
    gw.assert_responsive()


def test_busy_flood_at_the_cap_gets_503_then_clears(gw):
    socks: list[socket.socket] = []
    try:
        for _ in range(CAP + 20):  # started heads: not idle, so nothing makes room
            s = gw.connect()
            s.sendall(b"GET /health HTTP/1.1\r\n")
            socks.append(s)
        replies = [read_all(s) for s in socks]  # 503 at once past the cap, 408 at the header deadline
        statuses = [status_of(r) for r in replies]
        assert statuses.count(503) >= 10 and set(statuses) <= {408, 503}, statuses
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: gw.fds() < 40, 5, 0.05, "connections closed")
    gw.assert_responsive()


def test_per_key_cap_on_bytes_being_uploaded_at_once(gw, keys):
    # limits.max_upload_bytes_per_key is 128 MiB: four 30 MiB uploads in progress fit, a fifth does not.
    uploads = []
    try:
        for _ in range(4):
            s = gw.connect()
            s.sendall(post_head(keys.alice, 30 * MIB) + b'{"model": "test-model", ')
            uploads.append(s)
        gw.assert_responsive()  # the four are being read: their grants are taken by now
        with gw.connect() as s:
            s.sendall(post_head(keys.alice, 30 * MIB) + b'{"model": "test-model", ')
            reply = read_all(s)
        assert status_of(reply) == 429 and error_code(reply) == "rate_limit_exceeded" and b"retry-after: 1" in reply.lower()
        assert b"being uploaded at once" in reply
        # Another key's budget is its own.
        body = orjson.dumps({"model": "allowed-model", "messages": [{"role": "user", "content": "hi"}]})
        with gw.connect() as s:
            s.sendall(post_head(keys.bob, len(body)) + body)
            reply = read_all(s)
        assert status_of(reply) != 429
    finally:
        for s in uploads:
            s.close()
    # The budget comes back when the uploads end (here: their clients left).
    body = orjson.dumps({"model": "nope", "messages": []})

    def freed() -> bool:
        with gw.connect() as s:
            s.sendall(post_head(keys.alice, len(body), extra=b"Connection: close\r\n") + body)
            return status_of(read_all(s)) != 429

    wait_until(freed, 5, 0.05, "the upload budget released")
