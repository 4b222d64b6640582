"""The lean RESP pipe (gateway/state/resp.py) against a real redis-server: framing, replies in
order across batches in flight, error replies in place, the handshake, deadlines and reconnects."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import pytest
import redis as syncredis

from gateway.state.resp import ReplyError, RespPipe, pack
from redisd import RedisServer

pytestmark = pytest.mark.e2e  # a real redis-server


def _k(name: str) -> bytes:
    return f"resp{secrets.token_hex(4)}:{name}".encode()


async def test_a_batch_gets_its_replies_in_order_whatever_their_shape(redis_server):
    pipe = RespPipe(redis_server.url, 2.0)
    try:
        k, big, h = _k("s"), _k("big"), _k("h")
        value = os.urandom(1 << 20) + b"\r\n$5\r\n"  # larger than one read, and with RESP framing inside
        batch = [
            pack(b"SET", k, b"v"),
            pack(b"GET", k),
            pack(b"INCR", _k("n")),
            pack(b"GET", _k("missing")),
            pack(b"SET", big, value),
            pack(b"GET", big),
            pack(b"HSET", h, b"a", b"1", b"b", b"2"),
            pack(b"EVAL", b"return {1, 'x', {2, 3}, redis.call('HGET', KEYS[1], 'b')}", b"1", h),
        ]
        got = await pipe.request(b"".join(batch), len(batch))
        assert got == [b"OK", b"v", 1, None, b"OK", value, 2, [1, b"x", [2, 3], b"2"]]
    finally:
        pipe.close()


async def test_many_batches_in_flight_on_one_connection_each_get_their_own_replies(redis_server):
    pipe = RespPipe(redis_server.url, 2.0)
    try:
        k = _k("c")
        futs = [pipe.request(pack(b"INCR", k) + pack(b"ECHO", b"%d" % i), 2) for i in range(500)]
        results = await asyncio.gather(*futs)
        assert results == [[i + 1, b"%d" % i] for i in range(500)]
    finally:
        pipe.close()


async def test_an_error_reply_takes_its_place_and_the_rest_of_the_batch_still_arrives(redis_server):
    pipe = RespPipe(redis_server.url, 2.0)
    try:
        k = _k("e")
        batch = [pack(b"SET", k, b"not a number"), pack(b"INCR", k), pack(b"EVALSHA", b"0" * 40, b"0"), pack(b"GET", k)]
        got = await pipe.request(b"".join(batch), len(batch))
        assert got[0] == b"OK" and got[3] == b"not a number"
        assert isinstance(got[1], ReplyError) and "not an integer" in str(got[1])
        assert isinstance(got[2], ReplyError) and str(got[2]).startswith("NOSCRIPT")
        assert await pipe.request(pack(b"PING"), 1) == [b"PONG"]  # the connection is still in step
    finally:
        pipe.close()


async def test_the_url_selects_the_database_and_authenticates():
    with RedisServer() as server:
        with syncredis.Redis(port=server.port) as admin:
            admin.config_set("requirepass", "s3cret")
        k = _k("db")
        pipe = RespPipe(f"redis://:s3cret@127.0.0.1:{server.port}/3", 2.0)
        try:
            assert await pipe.request(pack(b"SET", k, b"in 3"), 1) == [b"OK"]
        finally:
            pipe.close()
        query = RespPipe(f"redis://:s3cret@127.0.0.1:{server.port}?db=4", 2.0)
        try:
            assert await query.request(pack(b"SET", k, b"in 4"), 1) == [b"OK"]
        finally:
            query.close()
        with syncredis.Redis(port=server.port, db=3, password="s3cret") as r3:
            assert r3.get(k) == b"in 3"
        with syncredis.Redis(port=server.port, db=4, password="s3cret") as r4:
            assert r4.get(k) == b"in 4"
        wrong = RespPipe(f"redis://:nope@127.0.0.1:{server.port}/0", 2.0)
        try:
            with pytest.raises(ConnectionError, match="handshake"):
                await wrong.request(pack(b"PING"), 1)
        finally:
            wrong.close()


async def test_a_redis_that_stops_answering_fails_every_batch_in_flight_at_the_deadline_then_reconnects():
    with RedisServer() as server:
        pipe = RespPipe(server.url, 0.3)
        try:
            assert await pipe.request(pack(b"PING"), 1) == [b"PONG"]
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                first = pipe.request(pack(b"PING"), 1)
                await asyncio.sleep(0.1)
                second = pipe.request(pack(b"PING"), 1)  # younger: it fails with the first (replies could no longer be matched)
                for fut in (first, second):
                    with pytest.raises(TimeoutError):
                        await fut
                assert time.monotonic() - t0 < 1.5
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert await pipe.request(pack(b"PING"), 1) == [b"PONG"]  # a fresh connection
        finally:
            pipe.close()


async def test_a_restart_fails_what_was_in_flight_and_the_next_request_connects_again():
    with RedisServer() as server:
        pipe = RespPipe(server.url, 2.0)
        try:
            assert await pipe.request(pack(b"PING"), 1) == [b"PONG"]
            server.stop()
            with pytest.raises(OSError):  # refused: nothing listens
                await pipe.request(pack(b"PING"), 1)
            server.start()
            assert await pipe.request(pack(b"PING"), 1) == [b"PONG"]
        finally:
            pipe.close()


async def test_a_closed_pipe_refuses_at_once(redis_server):
    pipe = RespPipe(redis_server.url, 2.0)
    assert await pipe.request(pack(b"PING"), 1) == [b"PONG"]
    pipe.close()
    with pytest.raises(ConnectionError):
        await pipe.request(pack(b"PING"), 1)


def test_only_redis_urls_are_taken():
    with pytest.raises(ValueError, match="scheme"):
        RespPipe("http://127.0.0.1:6379/0", 1.0)


async def test_a_reply_over_the_cap_drops_the_connection_before_the_deadline_not_buffered():
    # Whatever answers on Redis's port is bounded like a backend: a bulk reply that announces 1 GB and
    # keeps sending is dropped once the unparsed bytes pass the cap, long before the batch's deadline.
    sent = 0

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.read(64)
        writer.write(b"$1000000000\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(1024):  # 64 MiB at most
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(flood, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = RespPipe(f"redis://127.0.0.1:{port}/0", 10.0, max_reply_bytes=1 << 20)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="over"):
            await pipe.request(pack(b"PING"), 1)
        assert time.monotonic() - t0 < 5.0
        assert sent < 32 << 20  # dropped, not read to the end
    finally:
        pipe.close()
        server.close()
        await server.wait_closed()
