"""A stream's body through the native client, however the backend's bytes fall into reads:
several frames in one read, a frame split across reads, the usage frame split across reads.
The bytes relayed are the bytes sent, and the stream's bounds (line, event) hold across reads."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from gateway.config import TimeoutsConfig, UpstreamConfig
from gateway.upstream import EVENTS_PER_LINE, LineBound, NativeUpstream, UpstreamInvalid

pytestmark = pytest.mark.e2e  # loopback sockets (the relay tests)

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FRAMES = [b'data: {"choices":[{"delta":{"content":"t%d "}}]}\n\n' % i for i in range(6)]
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":6,"total_tokens":14}}\n\n'
DONE = b"data: [DONE]\n\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))


@contextlib.asynccontextmanager
async def serving(handler, max_line: int | None = None):
    """A loopback backend running ``handler``, and a client for it: (client, url); both closed after."""
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    up = NativeUpstream(TimeoutsConfig(first_byte=5, idle=5), UpstreamConfig() if max_line is None else UpstreamConfig(max_line_bytes=max_line))
    try:
        yield up, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/chat/completions"
    finally:
        await up.aclose()
        srv.close()
        await srv.wait_closed()


def backend(pieces: list[bytes]):
    """A handler that answers one request with ``pieces``, each in its own write, a pause between
    them so that each arrives in its own read."""

    async def serve(reader, writer):
        await read_request(reader)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.close()

    return serve


def relay(pieces: list[bytes], max_line: int = 4096) -> tuple[list[bytes], str | None]:
    """The chunks the client hands over, and the UpstreamInvalid reason if the stream was refused."""

    async def go():
        got: list[bytes] = []
        reason = None
        async with serving(backend(pieces), max_line) as (up, url):
            r = await up.open(url, b"{}", [])
            try:
                async for chunk in r.chunks():
                    got.append(chunk)
            except UpstreamInvalid as exc:
                reason = exc.reason
            finally:
                await r.aclose()
        return got, reason

    return asyncio.run(go())


def test_several_frames_in_one_read_are_handed_over_together():
    events = b"".join(FRAMES) + USAGE + DONE
    got, reason = relay([HEAD + chunked(events) + b"0\r\n\r\n"])
    assert reason is None
    assert got == [events]  # one read, one chunk: one write to the client, not one per frame


def test_a_frame_split_across_reads_arrives_whole_and_in_order():
    events = b"".join(FRAMES)
    cut = len(FRAMES[0]) + 7  # inside the second frame's JSON
    pieces = [HEAD + chunked(events[:cut]), chunked(events[cut:]), chunked(USAGE + DONE) + b"0\r\n\r\n"]
    got, reason = relay(pieces)
    assert reason is None
    assert len(got) >= 2
    assert b"".join(got) == events + USAGE + DONE


def test_the_usage_frame_split_across_reads_arrives_whole():
    cut = USAGE.index(b'"usage"') + 3  # the key itself is cut in two
    pieces = [HEAD + chunked(b"".join(FRAMES) + USAGE[:cut]), chunked(USAGE[cut:] + DONE) + b"0\r\n\r\n"]
    got, reason = relay(pieces)
    assert reason is None
    assert b"".join(got) == b"".join(FRAMES) + USAGE + DONE
    assert got[-1].endswith(DONE)


def test_a_line_over_the_limit_is_refused_though_it_comes_in_pieces():
    # No newline for 300 bytes, in three reads of 100: each read alone is under the limit of 256.
    pieces = [HEAD + chunked(b"data: " + b"x" * 94), chunked(b"x" * 100), chunked(b"x" * 100)]
    got, reason = relay(pieces, max_line=256)
    assert reason == "line_too_long"


def test_an_event_over_the_limit_is_refused_though_its_lines_are_short():
    line = b"data: " + b"x" * 50 + b"\n"  # 57 bytes, under the line limit of 64
    lines = line * (64 * EVENTS_PER_LINE // len(line) + 2)  # one event (no blank line) over 4 x 64 bytes
    got, reason = relay([HEAD + chunked(lines[:100]), chunked(lines[100:])], max_line=64)
    assert reason == "event_too_long"


def _reference_check(bound: LineBound, chunk: bytes) -> None:
    """LineBound.check as it was written before its blank-line search was narrowed: the two must agree."""
    nl = chunk.rfind(b"\n")
    bound.line = bound.line + len(chunk) if nl < 0 else len(chunk) - nl - 1
    end = max(chunk.rfind(b"\n\n"), chunk.rfind(b"\n\r\n"))
    if end >= 0:
        bound.event = len(chunk) - end - 2
    elif bound.tail == b"\n" and (chunk.startswith(b"\n") or chunk.startswith(b"\r\n")):
        bound.event = len(chunk)
    else:
        bound.event += len(chunk)
    bound.tail = chunk[-1:]
    if bound.line > bound.max_line:
        raise UpstreamInvalid("line_too_long")
    if bound.event > bound.max_event:
        raise UpstreamInvalid("event_too_long")


@pytest.mark.parametrize("seed", range(40))
def test_line_bound_agrees_with_the_two_scan_reference(seed):
    rng = random.Random(seed)
    # Streams of short lines and blank lines in both line endings, cut at random places.
    alphabet = [b"\n", b"\r\n", b"\n\n", b"\r\n\r\n", b"\n\r\n", b"data: x", b"yy", b"\r"]
    stream = b"".join(rng.choice(alphabet) for _ in range(400))
    fast, ref = LineBound(24), LineBound(24)
    i = 0
    while i < len(stream):
        j = i + rng.randint(1, 40)
        chunk = stream[i:j]
        outcomes = []
        for bound, check in ((fast, LineBound.check), (ref, _reference_check)):
            try:
                check(bound, chunk)
                outcomes.append(None)
            except UpstreamInvalid as exc:
                outcomes.append(exc.reason)
        assert outcomes[0] == outcomes[1]
        assert (fast.line, fast.event, fast.tail) == (ref.line, ref.event, ref.tail)
        if outcomes[0] is not None:
            fast, ref = LineBound(24), LineBound(24)
        i = j


def test_one_connection_carries_streams_and_sized_answers_in_turn():
    """A kept connection keeps its parser: chunked and sized responses in turn are each parsed whole."""
    events = b"".join(FRAMES) + USAGE + DONE
    sized = b'{"ok": 1}'
    answers = [
        HEAD + chunked(events) + b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(sized), sized),
        HEAD + chunked(events[:40]) + chunked(events[40:]) + b"0\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(sized), sized),
    ]

    async def go():
        connections = 0

        async def serve(reader, writer):
            nonlocal connections
            connections += 1
            try:
                for answer in answers:
                    await read_request(reader)
                    writer.write(answer)
                    await writer.drain()
                await reader.read()
            finally:
                writer.close()

        got = []
        async with serving(serve) as (up, url):
            for _ in answers:
                r = await up.open(url, b"{}", [])
                try:
                    got.append((r.status, await up.read_all(r)))
                finally:
                    await r.aclose()
        return got, connections

    got, connections = asyncio.run(go())
    assert got == [(200, events), (200, sized), (200, events), (204, b""), (200, sized)]
    assert connections == 1
