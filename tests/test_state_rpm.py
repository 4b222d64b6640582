"""The rpm log in Redis (a list of admission times, gateway/state/redis.py ADMIT) against the real
redis-server: the sliding window's edge, the remaining count and reset headers, its size, and the
expiries of the log and of the tpm bucket, set once in a while rather than on every request."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest

from gateway.config import ApiKeyConfig, parse_config
from gateway.errors import Refusal
from gateway.state.keys import hash_key, new_key
from gateway.state.redis import RedisStore

pytestmark = pytest.mark.e2e  # a real redis-server

MODEL = "m"


def _store(url: str) -> RedisStore:
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        # every admission decided in Redis: these tests read the log entry by entry (grants: test_state_grants.py)
                        "state": {"redis_url": url, "prefix": "q" + secrets.token_hex(4), "timeout": 1.0, "grant_seconds": 0}})
    return RedisStore(cfg)


@contextlib.asynccontextmanager
async def _started(url: str):
    store = _store(url)
    await store.start()
    try:
        yield store
    finally:
        await store.close()


async def _redis_ms(store: RedisStore) -> int:
    """Redis's clock in ms, as the scripts read it (TIME)."""
    sec, usec = await store.r.time()
    return sec * 1000 + usec // 1000


def _header(headers, name: bytes) -> bytes:
    return dict(headers)[name]


async def test_the_window_drops_admissions_60_s_old_and_counts_and_resets_from_the_oldest_left(redis_server):
    async with _started(redis_server.url) as store:
        key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=3)
        log = store._names(key)[0]
        now = await _redis_ms(store)
        # Four earlier admissions, oldest pushed first (the tail): 70 s and exactly 60 s old have left
        # the window (it holds the last 60 s, its start excluded); 50 s and 20 s old are in it. The
        # oldest is the log's refresh point (stored negated, see ADMIT).
        for at in (-(now - 70_000), now - 60_000, now - 50_000, now - 20_000):
            await store.r.lpush(log, at)
        await store.r.pexpire(log, 50_000)
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal), adm
        assert _header(adm.headers, b"x-ratelimit-remaining-requests") == b"0"  # 3 - 2 in the window - this one
        # Reset: when the oldest left (50 s old) leaves the window, ~10 s from now (the test's own time taken off).
        reset = _header(adm.headers, b"x-ratelimit-reset-requests")
        assert reset.endswith(b"s") and not reset.endswith(b"ms") and 9.0 <= float(reset[:-1]) <= 10.0, reset
        assert await store.r.llen(log) == 3  # the two expired popped, this one pushed
        # The refresh point left with them: the oldest left is the new one, and the log outlives it by 120 s.
        assert int(await store.r.lindex(log, -1)) == -(now - 50_000)
        assert 110_000 < await store.r.pttl(log) <= 120_000
        refused = await store.admit(key, MODEL, 5, 10)
        assert isinstance(refused, Refusal) and refused.reason == "rate_limited"
        retry_ms = int(_header(refused.headers, b"retry-after-ms"))
        assert 9000 <= retry_ms <= 10_000, retry_ms
        assert _header(refused.headers, b"x-ratelimit-remaining-requests") == b"0"
        assert await store.r.llen(log) == 3  # a refusal adds nothing


async def test_the_log_never_holds_more_than_rpm_and_expires_with_its_window(redis_server):
    async with _started(redis_server.url) as store:
        key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=5)
        log = store._names(key)[0]
        results = await asyncio.gather(*[store.admit(key, MODEL, 5, 10) for _ in range(40)])  # one pipelined batch
        assert sum(not isinstance(r, Refusal) for r in results) == 5
        assert await store.r.llen(log) == 5
        assert 60_000 < await store.r.pttl(log) <= 120_000  # an idle key's log goes once its window has passed


async def test_a_refusal_that_pops_the_refresh_point_still_keeps_the_log_alive_for_its_window(redis_server):
    # Were the log left to expire on its old deadline (5 s here) with two admissions of the last 30 s
    # in it, a third would be admitted within the minute.
    async with _started(redis_server.url) as store:
        key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=2)
        log = store._names(key)[0]
        now = await _redis_ms(store)
        for at in (-(now - 61_000), now - 30_000, now - 20_000):
            await store.r.lpush(log, at)
        await store.r.pexpire(log, 5_000)
        refused = await store.admit(key, MODEL, 5, 10)
        assert isinstance(refused, Refusal) and refused.reason == "rate_limited"
        assert await store.r.llen(log) == 2
        assert int(await store.r.lindex(log, -1)) == -(now - 30_000)
        assert 110_000 < await store.r.pttl(log) <= 120_000


async def test_the_tpm_bucket_outlives_its_last_update_by_120_s(redis_server):
    # Its expiry is set only when under 120 s of it are left (not on every update): a bucket that expired
    # early would read as full and let a key that ran over spend again.
    async with _started(redis_server.url) as store:
        key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_tpm=1_000_000)
        bucket = store._names(key)[1]
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal) and adm.shared, adm
        assert 230_000 < await store.r.pttl(bucket) <= 240_000
        now = await _redis_ms(store)
        await store.r.hset(bucket, "e", now + 100_000)
        await store.r.pexpire(bucket, 100_000)
        store.settle(adm, type("Outcome", (), {"ok": True, "prompt_tokens": 5, "completion_tokens": 1})())
        await store.flush()  # the settle gives back 4 tokens: SETTLE_MANY updates the bucket
        assert 230_000 < await store.r.pttl(bucket) <= 240_000
        await store.r.pexpire(bucket, 100_000)
        await store.r.hset(bucket, "e", now + 100_000)
        assert not isinstance(await store.admit(key, MODEL, 5, 10), Refusal)
        assert 230_000 < await store.r.pttl(bucket) <= 240_000


async def test_a_former_sorted_set_log_left_by_an_older_replica_does_not_break_admission(redis_server):
    # During a rolling upgrade the old replicas' rpm log (a sorted set) lives under the old name.
    async with _started(redis_server.url) as store:
        key = ApiKeyConfig(name="k", hash=hash_key(new_key()), rate_limit_rpm=5)
        await store.r.zadd(f"{store.cfg.prefix}:rl:{key.hash[7:]}:r", {"old.1": 1})
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal) and adm.shared, adm
