"""A backend's usage is untrusted: a count is an int, not a bool, from 0 to ``MAX_USAGE_TOKENS``
(2**31 - 1); anything else is ignored as if absent, so the gateway's estimate applies and is
flagged as one, and it is logged once per backend, not per request. Through the real in-memory
store: a hostile backend's usage cannot give a key tpm tokens back, lower or overflow its budget,
or be counted as a token (a bool).

In memory: the router over a ``FakeUpstream`` (tests/fakes.py), then ``MemoryStore.settle``.
"""

from __future__ import annotations

import asyncio
import json
import logging

import orjson
import pytest

from fakes import JSON, SSE, Reply
from gateway.config import parse_config
from gateway.routing import router
from gateway.state.memory import MemoryStore
from test_router_unit import MESSAGES, A, B, Harness

pytestmark = pytest.mark.unit

KEY = "sha256:" + "2" * 64
HOSTILE = [-5000, -1, True, False, 2**31, 2**63, 10**30, 1e3, "8", [6], {"n": 1}]


@pytest.fixture(autouse=True)
def _fresh_log_memory():
    router._BAD_USAGE_LOGGED.clear()
    yield
    router._BAD_USAGE_LOGGED.clear()


def body(usage: dict) -> bytes:
    return json.dumps({"id": "x", "choices": [], "usage": usage}).encode()  # json: orjson refuses ints past 64 bits


async def outcome_of(reply: Reply, route=None):
    h = Harness({A: [reply]})
    assert (await h.forward() if route is None else await h.forward(route=route)) == 200
    return h.balancer.outcomes[0]


@pytest.mark.parametrize("bad", HOSTILE, ids=repr)
async def test_an_out_of_range_count_is_ignored_as_if_absent(bad):
    o = await outcome_of(Reply(200, JSON, [body({"prompt_tokens": bad, "completion_tokens": bad, "prompt_tokens_details": {"cached_tokens": bad}})]))
    assert (o.ok, o.prompt_tokens, o.completion_tokens, o.cached_tokens) == (True, None, None, None)
    # One bad field does not spoil a good one.
    o = await outcome_of(Reply(200, JSON, [body({"prompt_tokens": 8, "completion_tokens": bad})]))
    assert (o.prompt_tokens, o.completion_tokens) == (8, None)


async def test_the_bounds_themselves_are_accepted():
    o = await outcome_of(Reply(200, JSON, [body({"prompt_tokens": 0, "completion_tokens": router.MAX_USAGE_TOKENS})]))
    assert (o.prompt_tokens, o.completion_tokens) == (0, 2**31 - 1)


async def test_a_stream_with_a_hostile_usage_falls_back_to_the_estimate():
    frames = b"".join(b'data: {"choices":[{"delta":{"content":"t"}}]}\n\n' for _ in range(6))
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":-100,"completion_tokens":true}}\n\ndata: [DONE]\n\n'
    o = await outcome_of(Reply(200, SSE, [frames, usage]))
    assert o.prompt_tokens is None and o.completion_tokens == 6  # 8 events - 2


async def test_anthropic_cache_counts_are_bounded_too():
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 20, "cache_read_input_tokens": -15, "output_tokens": 1}}}
    stream = b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\nevent: message_delta\ndata: " + orjson.dumps(
        {"type": "message_delta", "usage": {"output_tokens": 9}}) + b"\n\n"
    o = await outcome_of(Reply(200, SSE, [stream]), route=MESSAGES)
    assert (o.prompt_tokens, o.completion_tokens, o.cached_tokens) == (None, 9, None)
    # Each part in range but their sum past the cap: ignored as well.
    start["message"]["usage"] = {"input_tokens": 2**31 - 1, "cache_read_input_tokens": 1}
    o = await outcome_of(Reply(200, JSON, [orjson.dumps(start["message"])]), route=MESSAGES)
    assert o.prompt_tokens is None and o.cached_tokens == 1


async def test_an_invalid_usage_is_logged_once_per_backend(caplog):
    bad = Reply(200, JSON, [body({"prompt_tokens": -1, "completion_tokens": True})])
    with caplog.at_level(logging.WARNING, logger="gateway.router"):
        for _ in range(3):
            await outcome_of(bad)
        h = Harness({A: [], B: [bad]})  # another backend (b1): its own line
        h.pool.remove("b0")
        assert await h.forward() == 200 and h.upstream.backends_called() == [B]
    logged = [r.getMessage() for r in caplog.records if "invalid usage" in r.getMessage()]
    assert len(logged) == 2 and "b0" in logged[0] and "b1" in logged[1], logged


def test_a_hostile_usage_cannot_refund_tpm_lower_the_budget_or_count_a_bool():
    cfg = parse_config({"auth": {"keys": [{"name": "k", "hash": KEY, "rate_limit_tpm": 10_000, "budget_tokens": 1_000_000,
                                           "budget_period": "total"}]}, "backends": [{"url": "http://127.0.0.1:9"}]})
    store = MemoryStore(cfg)
    key = cfg.auth.keys[0]

    async def run():
        for usage in ({"prompt_tokens": -10**6, "completion_tokens": -10**6}, {"prompt_tokens": True, "completion_tokens": True},
                      {"prompt_tokens": 2**63, "completion_tokens": 10**30}):
            adm = await store.admit(key, "m", 20, 100)  # 120 reserved
            store.settle(adm, await outcome_of(Reply(200, JSON, [body(usage)])))
        (row,) = await store.usage()
        return row

    row = asyncio.run(run())
    # Each request: the prompt estimate (20), no completion, flagged as an estimate.
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.estimated) == (3, 60, 0, 3)
    assert sum(store.limiter._budget.values()) == 60  # charged the estimates: never less, never huge
    left = store.limiter.admit(key, 0, "").tokens_left
    assert 10_000 - 60 - 1 <= left <= 10_000  # the bucket neither refunded past its reservation nor sank
