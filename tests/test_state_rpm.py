"""The rpm log in Redis (a list of admission times, gateway/state/redis.py ADMIT) against the real
redis-server: the sliding window's edge, the remaining count and reset headers, and its size."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from gateway.config import ApiKeyConfig, parse_config
from gateway.errors import Refusal
from gateway.filters.auth import hash_key, new_key
from gateway.state.redis import RedisStore

pytestmark = pytest.mark.e2e  # a real redis-server

MODEL = "m"


def _store(url: str) -> RedisStore:
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": url, "prefix": "q" + secrets.token_hex(4), "timeout": 1.0}})
    return RedisStore(cfg)


def _header(headers, name: bytes) -> bytes:
    return dict(headers)[name]


async def test_the_window_drops_admissions_60_s_old_and_counts_and_resets_from_the_oldest_left(redis_server):
    store = _store(redis_server.url)
    await store.start()
    key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=3)
    log = store._names(key)[0]
    try:
        sec, usec = await store.r.time()
        now = sec * 1000 + usec // 1000
        # Four earlier admissions, oldest pushed first (the tail): 70 s and exactly 60 s old have left
        # the window (it holds the last 60 s, its start excluded); 50 s and 20 s old are in it.
        for age in (70_000, 60_000, 50_000, 20_000):
            await store.r.lpush(log, now - age)
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal), adm
        assert _header(adm.headers, b"x-ratelimit-remaining-requests") == b"0"  # 3 - 2 in the window - this one
        # Reset: when the oldest left (50 s old) leaves the window, ~10 s from now (the test's own time taken off).
        reset = _header(adm.headers, b"x-ratelimit-reset-requests")
        assert reset.endswith(b"s") and not reset.endswith(b"ms") and 9.0 <= float(reset[:-1]) <= 10.0, reset
        assert await store.r.llen(log) == 3  # the two expired popped, this one pushed
        refused = await store.admit(key, MODEL, 5, 10)
        assert isinstance(refused, Refusal) and refused.reason == "rate_limited"
        retry_ms = int(_header(refused.headers, b"retry-after-ms"))
        assert 9000 <= retry_ms <= 10_000, retry_ms
        assert _header(refused.headers, b"x-ratelimit-remaining-requests") == b"0"
        assert await store.r.llen(log) == 3  # a refusal adds nothing
    finally:
        await store.close()


async def test_the_log_never_holds_more_than_rpm_and_expires_with_its_window(redis_server):
    store = _store(redis_server.url)
    await store.start()
    key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=5)
    log = store._names(key)[0]
    try:
        results = await asyncio.gather(*[store.admit(key, MODEL, 5, 10) for _ in range(40)])  # one pipelined batch
        assert sum(not isinstance(r, Refusal) for r in results) == 5
        assert await store.r.llen(log) == 5
        assert 0 < await store.r.pttl(log) <= 61_000  # an idle key's log goes once its window has passed
    finally:
        await store.close()


async def test_a_former_sorted_set_log_left_by_an_older_replica_does_not_break_admission(redis_server):
    # During a rolling upgrade the old replicas' rpm log (a sorted set) lives under the old name.
    store = _store(redis_server.url)
    await store.start()
    key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=5)
    try:
        await store.r.zadd(f"{store.cfg.prefix}:rl:{key.hash[7:]}:r", {"old.1": 1})
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal) and adm.shared, adm
    finally:
        await store.close()
