"""The router's retry and relay rules, in memory: a ``FakeUpstream`` answers, no socket is opened.

Retries happen only before the client saw a byte; after that the response is relayed as it is and
a stream that breaks ends with an error event. Every dispatch is completed exactly once, whatever
happens, the client going away included; every upstream response is closed.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from fakes import JSON, REFUSED, RESET, SSE, Capture, Fail, FakeUpstream, Hang, RecordingBalancer, Reply, Stall, sse
from gateway.config import HealthConfig, TimeoutsConfig, UpstreamConfig
from gateway.errors import Refusal
from gateway.filters import RequestContext
from gateway.routes import ROUTES
from gateway.routing.pool import Backend, BackendPool
from gateway.routing.router import Router
from gateway.upstream import UpstreamFailure, UpstreamInvalid, UpstreamTimeout

pytestmark = pytest.mark.unit

A, B = "http://10.0.0.1:23333", "http://10.0.0.2:23333"
CHAT = ROUTES[("POST", "/v1/chat/completions")]
MESSAGES = ROUTES[("POST", "/v1/messages")]
OK = b'{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
# Deadlines short enough that a test waits for one in a fraction of a second.
FAST = TimeoutsConfig(connect=0.2, first_byte=0.2, idle=0.2)


class Harness:
    def __init__(self, script: dict[str, list], retries: int = 1, timeouts: TimeoutsConfig | None = None, limits: UpstreamConfig | None = None):
        self.pool = BackendPool(HealthConfig(failures_to_eject=100))
        for i, base in enumerate(script):
            self.pool.add(Backend(id=f"b{i}", url=base, api_key=f"key-{i}", models=frozenset({"m"}), static_models=True, healthy=True))
        self.upstream = FakeUpstream(script, timeouts, limits)
        self.balancer = RecordingBalancer()
        self.router = Router(self.pool, self.balancer, self.upstream, retries=retries)
        self.refusals: list[Refusal] = []
        self.send = Capture()

    async def reply(self, refusal: Refusal) -> None:
        self.refusals.append(refusal)

    async def forward(self, body: dict | None = None, route=CHAT, send: Capture | None = None) -> int:
        if send is not None:
            self.send = send
        ctx = RequestContext({"type": "http"}, route, {})
        ctx.body = body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        ctx.model = "m"
        self.ctx = ctx
        return await self.router.forward(ctx, orjson.dumps(ctx.body), [(b"content-type", b"application/json")], self.send, self.reply)

    def completed_once_per_dispatch(self) -> bool:
        dispatched = [b for what, b in self.balancer.events if what == "dispatched"]
        completed = [b for what, b in self.balancer.events if what == "completed"]
        return dispatched == completed and len(dispatched) == len(self.upstream.calls)

    def all_closed(self) -> bool:
        return all(c.closed for c in self.upstream.calls)


# -- retry before the first byte ---------------------------------------------------------------
@pytest.mark.parametrize("first", [REFUSED, RESET, Reply(503, chunks=[b"busy"]), Reply(502, chunks=[b"bad"])], ids=["refused", "reset", "503", "502"])
async def test_a_failure_before_the_first_byte_is_retried_once_on_another_backend(first):
    h = Harness({A: [first], B: [Reply(200, JSON, [OK])]})
    assert await h.forward() == 200
    assert h.upstream.backends_called() == [A, B]
    assert h.send.status == 200 and h.send.body == OK and h.refusals == []
    assert h.completed_once_per_dispatch() and h.all_closed()
    assert [o.ok for o in h.balancer.outcomes] == [False, True]
    assert h.balancer.outcomes[1].prompt_tokens == 3 and h.balancer.outcomes[1].completion_tokens == 2
    # Each backend got its own key, never the other's.
    assert (b"authorization", b"Bearer key-0") in h.upstream.calls[0].headers
    assert (b"authorization", b"Bearer key-1") in h.upstream.calls[1].headers


async def test_retries_are_bounded_and_the_last_failure_is_answered():
    h = Harness({A: [REFUSED], B: [REFUSED]}, retries=1)
    assert await h.forward() == 502
    assert h.upstream.backends_called() == [A, B]
    assert [r.reason for r in h.refusals] == ["upstream_unreachable"] and h.send.messages == []
    assert h.completed_once_per_dispatch()


async def test_a_503_on_the_last_try_is_our_own_error_with_the_status_and_retry_after_kept():
    h = Harness({A: [Reply(503, [*JSON, (b"retry-after", b"7")], [b'{"detail": "Traceback at 10.0.0.1"}'])]}, retries=0)
    assert await h.forward() == 503
    (refusal,) = h.refusals
    assert refusal.status == 503 and refusal.reason == "upstream_error" and "10.0.0.1" not in refusal.message
    assert (b"retry-after", b"7") in refusal.headers
    assert h.all_closed()


async def test_an_invalid_response_is_not_retried():
    h = Harness({A: [Fail(UpstreamInvalid("malformed"))], B: [Reply(200, JSON, [OK])]})
    assert await h.forward() == 502
    assert h.upstream.backends_called() == [A]
    assert [r.reason for r in h.refusals] == ["upstream_invalid_response"]
    assert h.completed_once_per_dispatch()


# -- no retry after the first byte -------------------------------------------------------------
async def test_a_stream_that_breaks_mid_way_is_not_retried_and_ends_with_an_error_event():
    h = Harness({A: [Reply(200, SSE, [*sse('{"n":1}', '{"n":2}'), UpstreamFailure("reset")])], B: [Reply(200, SSE, sse("[DONE]"))]})
    assert await h.forward() == 200
    assert h.upstream.backends_called() == [A], "the client saw bytes: no second try"
    assert h.send.status == 200 and h.refusals == []
    bodies = [m for m in h.send.messages if m["type"] == "http.response.body"]
    assert [m["body"] for m in bodies[:2]] == sse('{"n":1}', '{"n":2}')
    last = bodies[-1]
    assert last["more_body"] is False and last["body"].startswith(b"data: ") and b"error" in last["body"]
    assert b"[DONE]" not in h.send.body
    assert h.completed_once_per_dispatch() and h.all_closed()
    assert h.balancer.outcomes[0].ok is False


async def test_an_anthropic_stream_that_breaks_ends_with_an_anthropic_error_event():
    h = Harness({A: [Reply(200, SSE, [b"event: message_start\ndata: {}\n\n", UpstreamFailure("reset")])]})
    assert await h.forward(route=MESSAGES) == 200
    assert b"event: error" in h.send.body and b'"type":"error"' in h.send.body.replace(b" ", b"")


async def test_a_whole_response_that_breaks_while_being_read_is_answered_not_retried():
    h = Harness({A: [Reply(200, JSON, [b'{"id":', UpstreamFailure("reset")])], B: [Reply(200, JSON, [OK])]})
    await h.forward()
    assert h.upstream.backends_called() == [A]
    assert [r.reason for r in h.refusals] == ["upstream_unreachable"] and h.send.messages == []
    assert h.completed_once_per_dispatch() and h.all_closed()


@pytest.mark.parametrize(
    "broken, status",
    [(UpstreamFailure("reset"), 502), (UpstreamInvalid("malformed"), 502), (UpstreamInvalid("body_too_large"), 502), (Stall(), 504)],
    ids=["reset", "invalid", "too_large", "idle"],
)
async def test_forward_returns_the_status_the_client_got_when_a_whole_body_breaks(broken, status):
    # The access log and the metrics take this status: the client's, not the backend's 200.
    h = Harness({A: [Reply(200, JSON, [b'{"id":', broken])]}, timeouts=FAST)
    try:
        assert await h.forward() == status
    finally:
        if isinstance(broken, Stall):
            broken.release()
    assert [r.status for r in h.refusals] == [status] and h.send.messages == []


async def test_a_complete_stream_is_relayed_chunk_by_chunk_and_counts_as_ok():
    events = sse('{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}', "[DONE]")
    h = Harness({A: [Reply(200, SSE, events)]})
    assert await h.forward() == 200
    bodies = [m["body"] for m in h.send.messages if m["type"] == "http.response.body"]
    assert bodies == [*events, b""]
    start = h.send.messages[0]
    assert (b"cache-control", b"no-cache") in start["headers"]
    outcome = h.balancer.outcomes[0]
    assert outcome.ok and outcome.prompt_tokens == 5 and outcome.completion_tokens == 1
    assert [what for what, _ in h.balancer.events] == ["dispatched", "first_byte", "completed"]


# -- timeouts are 504s -------------------------------------------------------------------------
async def test_no_response_head_within_the_first_byte_deadline_is_a_504_and_not_retried():
    hang = Hang()
    h = Harness({A: [hang], B: [Reply(200, JSON, [OK])]}, timeouts=FAST)
    assert await h.forward() == 504
    assert hang.reached.is_set() and h.upstream.backends_called() == [A]
    assert [r.reason for r in h.refusals] == ["upstream_first_byte_timeout"] and h.refusals[0].status == 504
    assert h.completed_once_per_dispatch()


async def test_a_connect_timeout_is_a_504():
    h = Harness({A: [Fail(UpstreamTimeout("connect"))]})
    assert await h.forward() == 504
    assert [r.reason for r in h.refusals] == ["upstream_connect_timeout"]


async def test_a_whole_body_that_stalls_is_a_504():
    stall = Stall()
    h = Harness({A: [Reply(200, JSON, [b'{"id":', stall])]}, timeouts=FAST)
    try:
        await h.forward()
    finally:
        stall.release()
    assert stall.reached.is_set()
    assert [r.reason for r in h.refusals] == ["upstream_idle_timeout"] and h.refusals[0].status == 504
    assert h.send.messages == [] and h.all_closed()


async def test_a_stream_that_goes_idle_mid_way_ends_with_an_error_event():
    stall = Stall()
    h = Harness({A: [Reply(200, SSE, [*sse('{"n":1}'), stall])]}, timeouts=FAST)
    try:
        assert await h.forward() == 200
    finally:
        stall.release()
    assert h.send.body.startswith(sse('{"n":1}')[0]) and b"error" in h.send.body.split(b"\n\n", 1)[1]
    assert h.send.messages[-1]["more_body"] is False
    assert h.completed_once_per_dispatch() and h.all_closed()


# -- the client goes away ----------------------------------------------------------------------
async def test_a_client_that_goes_away_mid_stream_cancels_the_upstream_request():
    stall = Stall()
    h = Harness({A: [Reply(200, SSE, [*sse('{"n":1}'), stall, *sse("[DONE]")])], B: [Reply(200, SSE, sse("[DONE]"))]})
    task = asyncio.ensure_future(h.forward())
    await stall.reached.wait()  # the first event has been relayed; the backend is generating
    task.cancel()  # what the listener does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await task
    stall.release()
    assert h.upstream.backends_called() == [A], "never retried"
    assert h.all_closed(), "the upstream response was closed: the backend stops generating"
    assert h.completed_once_per_dispatch() and h.balancer.outcomes[0].ok is False


async def test_a_client_gone_while_waiting_for_the_first_byte_is_completed_once():
    hang = Hang()
    h = Harness({A: [hang]})
    task = asyncio.ensure_future(h.forward())
    await hang.reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.completed_once_per_dispatch() and h.refusals == [] and h.send.messages == []


async def test_a_send_that_fails_mid_stream_closes_the_upstream_response_and_completes_once():
    h = Harness({A: [Reply(200, SSE, sse('{"n":1}', '{"n":2}', "[DONE]"))]})
    with pytest.raises(OSError):
        await h.forward(send=Capture(fail_on=1))
    assert h.all_closed() and h.completed_once_per_dispatch()


# -- what the router asks of the pool ----------------------------------------------------------
async def test_no_eligible_backend_is_a_503_and_an_unknown_model_a_404():
    h = Harness({A: [], B: []})
    for b in h.pool:
        b.healthy = False
    assert await h.forward() == 503
    assert h.refusals[-1].reason == "no_healthy_backend"
    h.ctx = None
    ctx = RequestContext({"type": "http"}, CHAT, {})
    ctx.body, ctx.model = {"model": "other"}, "other"
    assert await h.router.forward(ctx, b"{}", [], h.send, h.reply) == 404
    assert h.upstream.calls == []


async def test_a_refused_connection_takes_the_backend_out_of_rotation():
    h = Harness({A: [REFUSED], B: [Reply(200, JSON, [OK])]})
    await h.forward()
    a = h.pool.get("b0")
    assert not a.healthy and a.health_status == "unreachable"
    assert [b.id for b in h.pool.eligible("m")] == ["b1"]
