"""The disaggregated decode's stream relay reads what passes through it line by line, however the
backend's bytes fall into reads (the same ``SseScan`` as the router's relay): the usage frame, the
in-stream error event lmdeploy sends before ``[DONE]``, and ``[DONE]`` itself, each cut at every
offset, give what one read gives. ``progress["done"]`` (the decode engine frees the prefill's
blocks, not us) is set once ``[DONE]`` has passed, and not after an error event.

In memory: ``PDDispatcher._decode`` over a ``FakeUpstream`` (tests/fakes.py), each piece one read.
"""

from __future__ import annotations

import pytest

from fakes import SSE, Capture, FakeUpstream, Reply
from gateway.config import HealthConfig
from gateway.filters import RequestContext
from gateway.routes import ROUTES
from gateway.routing.disagg import PDDispatcher
from gateway.routing.pd_policy import DecodeRun
from gateway.routing.pool import Backend, BackendPool

pytestmark = pytest.mark.unit

D = "http://10.0.0.9:23333"
CHAT = ROUTES[("POST", "/v1/chat/completions")]
FRAMES = b"".join(b'data: {"choices":[{"delta":{"content":"t%d "}}]}\n\n' % i for i in range(4))
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":6,"total_tokens":14}}\n\n'
DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error":{"message":"engine failed","code":500}}\n\n'


async def decode(pieces: list[bytes], send: Capture | None = None):
    """Relay ``pieces`` (one read each) through a decode; the outcome, progress and what the client got."""
    pool = BackendPool(HealthConfig(failures_to_eject=100))
    d = Backend(id="d0", url=D, api_key="k", models=frozenset({"m"}), static_models=True, healthy=True)
    pool.add(d)
    disp = PDDispatcher(pool, {})
    disp.upstream = FakeUpstream({D: [Reply(200, SSE, list(pieces))]})
    ctx = RequestContext({"type": "http"}, CHAT, {})
    ctx.model = "m"
    progress = {"done": False}
    send = send or Capture()

    async def reply(refusal):  # pragma: no cover - a 200 stream is never refused
        raise AssertionError(refusal)

    send.left = False
    try:
        await disp._decode(d, ctx, b"{}", "/v1/chat/completions", [], send, reply, True, progress, DecodeRun(started=0.0, out_tokens=8))
    except OSError:  # the client went away (Capture's fail_on)
        send.left = True
    return ctx.outcome, progress["done"], send


def cuts(body: bytes, start: int = 1) -> list[list[bytes]]:
    return [[body[:i], body[i:]] for i in range(start, len(body))]


async def test_the_usage_is_exact_wherever_the_usage_frame_is_cut():
    body = FRAMES + USAGE + DONE
    for pieces in cuts(body, len(FRAMES)):
        outcome, done, sent = await decode(pieces)
        assert sent.body == body and done is True
        assert (outcome.ok, outcome.prompt_tokens, outcome.completion_tokens) == (True, 8, 6), pieces


async def test_the_usage_is_exact_in_one_byte_reads():
    body = FRAMES + USAGE + DONE
    outcome, done, _ = await decode([body[i:i + 1] for i in range(len(body))])
    assert done and (outcome.prompt_tokens, outcome.completion_tokens) == (8, 6)


async def test_an_error_event_cut_anywhere_is_seen_and_later_done_does_not_count():
    body = FRAMES + ERROR + DONE
    for pieces in cuts(body, len(FRAMES) - 3):
        outcome, done, sent = await decode(pieces)
        assert sent.body == body
        assert done is False and outcome.ok is False, pieces


async def test_done_cut_anywhere_is_seen_before_the_stream_ends():
    # The backend sends a comment after [DONE] and the client leaves as it is relayed: the decode
    # still counts as done, because [DONE] had passed (whatever the cut), so the prefill's blocks
    # are the decode engine's to free.
    body = FRAMES + USAGE + DONE
    for pieces in cuts(body, len(FRAMES) + len(USAGE) - 2):
        _, done, sent = await decode([*pieces, b": bye\n\n"], Capture(fail_on=len(pieces) + 1))
        assert sent.left and sent.body == body + b": bye\n\n" and done is True, pieces
    # Left before [DONE] came whole: not done.
    _, done, sent = await decode([FRAMES + USAGE + DONE[:8], DONE[8:]], Capture(fail_on=2))
    assert sent.left and done is False
