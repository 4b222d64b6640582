"""The usage a stream's backend reports reaches the outcome exactly, however its bytes fall into
reads: the usage frame split at any byte, across three reads, the ``data:`` prefix or a CRLF cut
in two, ``[DONE]`` in the same read or a later one. Without usage, the completion estimate (one
token per ``data:`` event, less the role chunk and ``[DONE]``) does not depend on the cuts either.

In memory: the router over a ``FakeUpstream`` (tests/fakes.py), each piece one read.
"""

from __future__ import annotations

import random

import pytest

from fakes import JSON, SSE, Reply
from gateway.config import UpstreamConfig
from test_router_unit import MESSAGES, A, Harness

pytestmark = pytest.mark.unit

FRAMES = b"".join(b'data: {"choices":[{"delta":{"content":"t%d "}}]}\n\n' % i for i in range(6))
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":6,"total_tokens":14}}\n\n'
DONE = b"data: [DONE]\n\n"
BODY = FRAMES + USAGE + DONE
NO_USAGE = FRAMES + DONE  # 7 events: the estimate is 7 - 2 = 5


async def relay(pieces: list[bytes], route=None, limits: UpstreamConfig | None = None):
    """Relay ``pieces`` (one read each); the outcome and the bytes the client got."""
    h = Harness({A: [Reply(200, SSE, list(pieces))]}, limits=limits)
    assert (await h.forward() if route is None else await h.forward(route=route)) == 200
    return h.balancer.outcomes[0], h.send.body


def cuts(body: bytes, start: int) -> list[list[bytes]]:
    """``body`` in two reads, cut at every offset from ``start`` to its end."""
    return [[body[:i], body[i:]] for i in range(start, len(body))]


async def test_the_usage_is_exact_wherever_the_last_two_frames_are_cut():
    for pieces in cuts(BODY, len(FRAMES)):
        outcome, sent = await relay(pieces)
        assert sent == BODY
        assert (outcome.ok, outcome.prompt_tokens, outcome.completion_tokens) == (True, 8, 6), pieces


async def test_the_usage_is_exact_across_three_reads():
    start = len(FRAMES)
    for i in range(start, start + len(USAGE)):
        for j in range(i + 1, start + len(USAGE) + 1):
            pieces = [BODY[:i], BODY[i:j], BODY[j:]]
            outcome, sent = await relay(pieces)
            assert sent == BODY
            assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6), pieces


async def test_a_usage_frame_in_one_byte_reads():
    outcome, sent = await relay([BODY[i:i + 1] for i in range(len(BODY))])
    assert sent == BODY and (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6)


@pytest.mark.parametrize("cut", [1, 3, 5], ids=["d|ata:", "dat|a:", "data:|"])
async def test_a_data_prefix_cut_in_two(cut):
    at = len(FRAMES) + cut
    outcome, _ = await relay([BODY[:at], BODY[at:]])
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6)


async def test_crlf_line_endings_wherever_cut():
    body = BODY.replace(b"\n", b"\r\n")
    for pieces in cuts(body, len(FRAMES.replace(b"\n", b"\r\n"))):
        outcome, sent = await relay(pieces)
        assert sent == body
        assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6), pieces


async def test_usage_and_done_in_the_same_read_or_a_later_one():
    for pieces in ([FRAMES, USAGE + DONE], [FRAMES + USAGE + DONE], [FRAMES, USAGE, DONE], [FRAMES + USAGE, DONE], [FRAMES, USAGE, b"", DONE]):
        outcome, _ = await relay(pieces)
        assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6), pieces


async def test_a_usage_frame_without_a_final_newline_still_counts():
    # As before the fix: a stream that ends on its usage line (no blank line after it) is read.
    outcome, _ = await relay([FRAMES, USAGE.rstrip(b"\n")])
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6)


async def test_the_last_usage_frame_wins():
    first = USAGE.replace(b"8", b"1").replace(b'"completion_tokens":6', b'"completion_tokens":2')
    body = FRAMES + first + USAGE + DONE
    for pieces in cuts(body, len(FRAMES) + len(first) - 3):
        outcome, _ = await relay(pieces)
        assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6), pieces


async def test_without_usage_the_estimate_counts_each_event_once_wherever_cut():
    outcome, _ = await relay([NO_USAGE])
    assert outcome.prompt_tokens is None and outcome.completion_tokens == 5
    for pieces in cuts(NO_USAGE, 1):
        outcome, _ = await relay(pieces)
        assert outcome.prompt_tokens is None and outcome.completion_tokens == 5, pieces
    outcome, _ = await relay([NO_USAGE[i:i + 1] for i in range(len(NO_USAGE))])
    assert outcome.completion_tokens == 5


async def test_a_null_usage_on_every_frame_leaves_the_estimate():
    # lmdeploy's chunks carry "usage":null unless the client asked for usage.
    body = FRAMES.replace(b"]}\n", b'],"usage":null}\n') + DONE
    for pieces in ([body], *cuts(body, len(body) - len(DONE) - 20)):
        outcome, _ = await relay(pieces)
        assert outcome.prompt_tokens is None and outcome.completion_tokens == 5, pieces


async def test_usage_values_that_are_not_integers_are_ignored():
    bad = USAGE.replace(b'"prompt_tokens":8', b'"prompt_tokens":"8"').replace(b'"completion_tokens":6', b'"completion_tokens":[6]')
    outcome, _ = await relay([FRAMES + bad[:20], bad[20:] + DONE])
    assert outcome.prompt_tokens is None and outcome.completion_tokens == 6  # the estimate: 8 events - 2


async def test_an_anthropic_message_delta_usage_cut_in_two():
    delta = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}\n\n'
    body = b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":25,"output_tokens":1}}}\n\n' + delta
    body += b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    at = body.index(delta) + delta.index(b'"usage"') + 2
    outcome, _ = await relay([body[:at], body[at:]], route=MESSAGES)
    assert outcome.completion_tokens == 15


async def test_a_responses_usage_cut_in_two():
    done = b'event: response.completed\ndata: {"type":"response.completed","response":{"status":"completed","usage":{"input_tokens":8,"output_tokens":6}}}\n\n'
    for pieces in cuts(done, 1):
        outcome, _ = await relay(pieces)
        assert (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6), pieces


async def test_a_line_longer_than_the_upstream_bound_ends_the_stream_whatever_the_reads():
    # The carried partial line never outgrows the upstream layer's line bound: the stream is refused first.
    long = b'data: {"choices":[],"usage":{"prompt_tokens":8,"pad":"' + b"x" * 3000
    outcome, sent = await relay([FRAMES, long[:1000], long[1000:2000], long[2000:], b'"}}\n\n'], limits=UpstreamConfig(max_line_bytes=1024))
    assert outcome.ok is False and outcome.prompt_tokens is None
    assert sent.startswith(FRAMES) and b"error" in sent[len(FRAMES):]


@pytest.mark.parametrize("seed", range(5))
async def test_random_reads_give_what_one_read_gives(seed):
    # A mixed stream (null usage frames, two usage frames, an event: line, CRLF or not) cut at random.
    rng = random.Random(seed)
    nulls = FRAMES.replace(b"]}\n", b'],"usage":null}\n')
    first = USAGE.replace(b"8", b"1")
    for body in (nulls + first + b"event: x\n" + USAGE + DONE, NO_USAGE + nulls, (nulls + USAGE + DONE).replace(b"\n", b"\r\n")):
        whole, _ = await relay([body])
        for _ in range(40):
            at = sorted(rng.sample(range(1, len(body)), rng.randint(1, 12)))
            pieces = [body[i:j] for i, j in zip([0, *at], [*at, len(body)])]
            outcome, sent = await relay(pieces)
            assert sent == body
            assert (outcome.prompt_tokens, outcome.completion_tokens) == (whole.prompt_tokens, whole.completion_tokens), at


def anthropic_stream(cached: int = 5) -> bytes:
    """As lmdeploy (and the simulator) send /v1/messages: input tokens in message_start (without
    the cached part, given apart), the output tokens in message_delta at the end."""
    start = b'{"type":"message_start","message":{"id":"m","usage":{"input_tokens":%d,"cache_creation_input_tokens":0,"cache_read_input_tokens":%d,"output_tokens":0}}}' % (25 - cached, cached)
    body = b"event: message_start\ndata: " + start + b"\n\n"
    body += b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    body += b'event: ping\ndata: {"type":"ping"}\n\n'
    body += b"".join(b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"t%d"}}\n\n' % i for i in range(3))
    body += b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    body += b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}\n\n'
    return body + b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


async def test_an_anthropic_stream_gives_the_prompt_from_message_start_and_the_output_from_message_delta_wherever_cut():
    body = anthropic_stream()
    for pieces in ([body], *cuts(body, 1)):
        outcome, sent = await relay(pieces, route=MESSAGES)
        assert sent == body
        assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens) == (25, 15, 5), pieces


async def test_an_anthropic_stream_read_a_line_at_a_time_or_an_event_at_a_time():
    # One line a read: message_start's data line comes in a read that ends a line after one that did.
    body = anthropic_stream(cached=0)
    for pieces in ([line + b"\n" for line in body.split(b"\n")[:-1]], [e + b"\n\n" for e in body.split(b"\n\n")[:-1]]):
        assert b"".join(pieces) == body
        outcome, _ = await relay(pieces, route=MESSAGES)
        assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens) == (25, 15, 0)


async def test_an_anthropic_reply_counts_its_cached_input_in_the_prompt():
    reply = b'{"type":"message","usage":{"input_tokens":5,"cache_creation_input_tokens":3,"cache_read_input_tokens":17,"output_tokens":4}}'
    h = Harness({A: [Reply(200, JSON, [reply])]})
    assert await h.forward(route=MESSAGES) == 200
    outcome = h.balancer.outcomes[0]
    assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens) == (25, 4, 17)
