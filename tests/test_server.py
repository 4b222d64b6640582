"""gateway/server as a process: its config, a busy port, lifespan, and the drain on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from gateway.config import ConfigError, parse_config
from gateway.server.limits import connection_cap
from support import ROOT, Sim, free_port, wait_until

pytestmark = pytest.mark.e2e


def _problems(server: dict) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config({"server": server, "auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}]})
    return exc.value.problems


def test_bad_server_limits_are_named_one_per_problem():
    problems = _problems({"max_headers": 0, "header_timeout": -1, "max_header_bytes": "big"})
    text = "\n".join(problems)
    assert len(problems) == 3, problems
    for field in ("server.max_headers", "server.header_timeout", "server.max_header_bytes"):
        assert field in text


def test_request_line_limit_cannot_exceed_the_head_limit():
    problems = _problems({"max_request_line_bytes": 32768, "max_header_bytes": 16384})
    assert problems == [p for p in problems if "server.max_request_line_bytes" in p] and "max_header_bytes" in problems[0]


def test_connection_cap_leaves_headroom_under_the_file_limit():
    assert connection_cap(1024) == 480  # half of what the 64 reserved files leave: one upstream per client
    assert connection_cap(256) == 96
    assert connection_cap(10) == 8


def _config(tmp_path, port: int, backend: str, **server) -> str:
    path = tmp_path / "gw.json"
    path.write_bytes(orjson.dumps({
        "server": {"port": port, "log_level": "info", **server},
        "auth": {"disabled": True},
        "backends": [{"url": backend, "api_key": "backend-secret", "models": ["test-model"]}],
        "health": {"interval": 0.5},
        "timeouts": {"drain": 10},
    }))
    return str(path)


def test_a_busy_port_is_a_clear_error_before_anything_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--config", _config(tmp_path, port, "http://127.0.0.1:9")],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        )
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in proc.stderr and "already in use" in proc.stderr
    assert "Traceback" not in proc.stderr and "gateway started" not in proc.stderr


def test_sigterm_drains_an_in_flight_stream_then_exits(tmp_path):
    with Sim("test-model", "--tpot", "0.05", api_key="backend-secret") as sim:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", _config(tmp_path, port, sim.url)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                try:
                    return httpx.get(url + "/ready", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(ready, 30, 0.05, "gateway ready")
            body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True}
            with httpx.Client(timeout=20) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(lines)
                assert first.startswith("data:")
                proc.send_signal(signal.SIGTERM)
                started = time.monotonic()
                wait_until(lambda: _refused(port), 5, 0.02, "the listening socket closed")
                rest = list(lines)  # the stream in flight runs to its end
            assert r.status_code == 200 and rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
            assert proc.wait(15) == 0
            assert time.monotonic() - started < 10
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            err = proc.stderr.read().decode() if proc.stderr else ""
            if proc.stderr:
                proc.stderr.close()
    assert "shutting down" in err and "Traceback" not in err


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


def test_a_failed_lifespan_start_up_ends_the_server_with_status_1():
    from gateway import server as http_server
    from gateway.config import ServerConfig

    async def app(scope, receive, send):
        assert scope["type"] == "lifespan"
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no backends could start"})

    sock = http_server.bind("127.0.0.1", 0)
    srv = http_server.Server(app, ServerConfig(), drain=1.0, sockets=[sock])
    loop = http_server.new_loop()
    try:
        assert loop.run_until_complete(srv.run(install_signals=False)) == 1
    finally:
        loop.close()
        sock.close()
    assert not srv.started


def test_start_serves_a_second_app_in_a_running_loop_with_the_same_bounds():
    import asyncio

    from gateway import server as http_server
    from gateway.config import ServerConfig

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> tuple[bytes, bytes]:
        sock = http_server.bind("127.0.0.1", 0)
        serving = await http_server.start(app, ServerConfig(max_headers=8), drain=1.0, sockets=[sock])
        try:
            answers = []
            for extra in (b"", b"X-A: 1\r\n" * 20):
                reader, writer = await asyncio.open_connection("127.0.0.1", serving.port)
                writer.write(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n" + extra + b"\r\n")
                answers.append(await asyncio.wait_for(reader.read(), 5))
                writer.close()
            return answers[0], answers[1]
        finally:
            await serving.stop()
            sock.close()

    loop = http_server.new_loop()
    try:
        ok, too_many = loop.run_until_complete(main())
    finally:
        loop.close()
    assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b"ok")
    assert too_many.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize("loop_name", ["uvloop", "asyncio"])
def test_both_sides_of_the_gateway_send_small_writes_at_once(loop_name):
    """TCP_NODELAY on the client's connection (our server) and on the backend's (our client), on
    either event loop: stdlib asyncio leaves it off on sockets accepted from our listening socket,
    and Nagle would then hold an SSE chunk until the previous one is acknowledged."""
    import asyncio

    import uvloop

    from gateway.h1 import H1Pool
    from gateway.server.serve import bind, start

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    async def go():
        cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1", "models": ["m"]}]})
        serving = await start(app, cfg.server, drain=1, sockets=[bind("127.0.0.1", 0)])
        pool = H1Pool("127.0.0.1", serving.port, 5)
        try:
            resp = await pool.request(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", b"")
            async for _ in resp.chunks():
                pass
            upstream = resp._conn.transport.get_extra_info("socket")
            (server_side,) = serving.connections.open
            accepted = server_side.transport.get_extra_info("socket")
            return (upstream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                    accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        finally:
            pool.close()
            await serving.stop()

    loop = uvloop.new_event_loop() if loop_name == "uvloop" else asyncio.new_event_loop()
    try:
        upstream, accepted = loop.run_until_complete(go())
    finally:
        loop.close()
    assert upstream and accepted


def test_the_serving_process_freezes_what_start_up_made_out_of_the_collectors_walks():
    """gateway serve's server (gc_tuning) takes start-up's objects out of full collections, which
    would otherwise stop the event loop, and every stream in flight, while they walk them all
    (~30 ms each here, measured with bench/ttft_added.py under a gc probe)."""
    import gc
    import threading

    from gateway.server.serve import Server, bind, new_loop

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return

    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1", "models": ["m"]}]})
    gc.unfreeze()
    thresholds = gc.get_threshold()
    server = Server(app, cfg.server, drain=1, sockets=[bind("127.0.0.1", 0)], gc_tuning=True)
    loop = new_loop()
    t = threading.Thread(target=lambda: loop.run_until_complete(server.run(install_signals=False)), daemon=True)
    t.start()
    try:
        wait_until(lambda: server.started, 10, what="server start")
        assert gc.get_freeze_count() > 0
    finally:
        server.request_stop()
        t.join(10)
        loop.close()
        gc.unfreeze()  # the rest of the test session collects as usual
        gc.set_threshold(*thresholds)


def test_the_disconnect_extension_hands_the_app_its_task_when_the_client_goes_away():
    """DISCONNECT_EXTENSION: the app learns of its client leaving without a task awaiting receive()
    (how the listener cancels the upstream request): called once, with the task that runs the app,
    at once for an app that registers after the client left; withdrawn, it is never called."""
    import asyncio

    from gateway import server as http_server
    from gateway.config import ServerConfig
    from gateway.server.protocol import DISCONNECT_EXTENSION

    calls: list[tuple[str, bool]] = []

    async def app(scope, receive, send):
        on_disconnect = scope["extensions"][DISCONNECT_EXTENSION]
        me = asyncio.current_task()
        if scope["path"] == "/withdrawn":
            on_disconnect(lambda task: calls.append(("withdrawn", task is me)))
            on_disconnect(None)
            await asyncio.sleep(0.3)  # the client leaves meanwhile
            return
        if scope["path"] == "/late":
            await asyncio.sleep(0.3)  # the client has left by now
            on_disconnect(lambda task: calls.append(("late", task is me)))
            return
        on_disconnect(lambda task: (calls.append(("gone", task is me)), task.cancel()))
        await asyncio.sleep(10)  # cancelled when the client leaves

    async def main() -> None:
        sock = http_server.bind("127.0.0.1", 0)
        serving = await http_server.start(app, ServerConfig(), drain=1.0, sockets=[sock])
        try:
            for path in (b"/gone", b"/late", b"/withdrawn"):
                reader, writer = await asyncio.open_connection("127.0.0.1", serving.port)
                writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: a\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.close()
                await asyncio.sleep(0.4)
        finally:
            await serving.stop()
            sock.close()

    loop = http_server.new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert calls == [("gone", True), ("late", True)]


def test_a_client_that_leaves_cancels_its_upstream_request(tmp_path):
    """Our server tells the listener itself (DISCONNECT_EXTENSION), and the backend sees its
    request aborted."""
    with Sim("test-model", "--ttft", "5", api_key="backend-secret") as sim:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", _config(tmp_path, port, sim.url)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            def ready() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(ready, 30, 0.05, "gateway ready")
            before = sim.stats()["aborted"]
            pending = sim.stats()["pending"]
            body = orjson.dumps({"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
                wait_until(lambda: sim.stats()["pending"] > pending, 5, 0.02, "the request to reach the backend")
            wait_until(lambda: sim.stats()["aborted"] == before + 1, 4, 0.05, "the backend to see its request aborted")
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_expect_continue_and_the_framing_headers_an_app_sets():
    """The header names the server looks at, either way: ``Expect: 100-continue`` (in any case) is
    answered when the app reads the body; an app's ``Connection: close`` ends the connection after
    its answer, and its ``Transfer-Encoding`` is dropped (the framing is the server's)."""
    import asyncio

    from gateway import server as http_server
    from gateway.config import ServerConfig

    async def app(scope, receive, send):
        body = (await receive())["body"]
        headers = [(b"Content-Length", str(len(body)).encode()), (b"X-Seen", b"1")]
        if scope["path"] == "/close":
            headers += [(b"Connection", b"close"), (b"Transfer-Encoding", b"chunked")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def main() -> tuple[bytes, bytes, bytes]:
        sock = http_server.bind("127.0.0.1", 0)
        serving = await http_server.start(app, ServerConfig(), drain=1.0, sockets=[sock])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", serving.port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nEXPECT: 100-Continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(b"hello")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            await asyncio.wait_for(reader.readexactly(5), 5)
            writer.write(b"POST /close HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
            closed = await asyncio.wait_for(reader.read(), 5)  # read() returns once the server closed
            writer.close()
            return interim, head, closed
        finally:
            await serving.stop()
            sock.close()

    loop = http_server.new_loop()
    try:
        interim, head, closed = loop.run_until_complete(main())
    finally:
        loop.close()
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert head.startswith(b"HTTP/1.1 200 ") and b"X-Seen: 1\r\n" in head and b"connection: close" not in head.lower()
    assert closed.startswith(b"HTTP/1.1 200 ") and closed.endswith(b"\r\n\r\nhi")
    assert b"connection: close\r\n" in closed.lower() and b"transfer-encoding" not in closed.lower()
