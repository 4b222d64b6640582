"""Grants (gateway/state/grants.py): blocks of a key's quota decided in the process while the key is far
from its limits, against the real redis-server. The limits stay exact across replicas; what a grant
leaves unused goes back; a key near a limit, or past half its budget, is decided request by request."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from gateway.config import ApiKeyConfig, parse_config
from gateway.errors import Refusal
from gateway.state.keys import hash_key, new_key
from gateway.state.redis import RedisStore

pytestmark = pytest.mark.e2e  # a real redis-server

MODEL = "m"


class _Outcome:
    ok = True
    prompt_tokens = 3
    completion_tokens = 4


def _store(url: str, prefix: str, grant_seconds: float = 5.0) -> RedisStore:
    # A long life: the tests end grants themselves (end_grants), so no timer ends one between two readings.
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": url, "prefix": prefix, "timeout": 1.0, "grant_seconds": grant_seconds}})
    return RedisStore(cfg)


async def _loaded(url: str, prefix: str | None = None, grant_seconds: float = 5.0) -> RedisStore:
    """Scripts loaded, no background task (no heartbeat between two readings)."""
    store = _store(url, prefix or "g" + secrets.token_hex(4), grant_seconds)
    await store._load_scripts()
    return store


async def _scripts(store: RedisStore) -> int:
    return (await store.r.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)


def _key(**limits) -> ApiKeyConfig:  # type: ignore[no-untyped-def]
    return ApiKeyConfig(name="k", hash=hash_key(new_key()), **limits)


async def _second(store: RedisStore, key: ApiKeyConfig, reserve: int = 0, max_tokens: int | None = None):  # type: ignore[no-untyped-def]
    """The key's second admission: the first went to Redis and asked for a grant, this one may come from it."""
    await store.admit(key, MODEL, reserve, max_tokens)
    return await store.admit(key, MODEL, reserve, max_tokens)


async def test_far_from_its_limits_a_key_is_admitted_from_a_grant_and_every_count_comes_out_exact(redis_server):
    store = await _loaded(redis_server.url)
    key = _key(rate_limit_rpm=100_000, rate_limit_tpm=10_000_000, max_concurrent=1_000)
    try:
        first = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(first, Refusal) and first.grant is None  # decided in Redis, and asked for a grant
        store.settle(first, _Outcome())
        before = await _scripts(store)
        got = []
        for _ in range(20):  # one at a time, each settled: the grant's slots come back to it
            adm = await store.admit(key, MODEL, 5, 10)
            assert not isinstance(adm, Refusal) and adm.grant is not None
            got.append(adm)
            store.settle(adm, _Outcome())
        assert await _scripts(store) == before  # no script run for them
        remaining = [int(dict(a.headers)[b"x-ratelimit-remaining-requests"]) for a in got]
        assert remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 20  # counted down
        store.end_grants()
        await store.flush()
        r_key, t_key, cc_key, _ = store._names(key)
        assert await store.r.llen(r_key) == 21  # exactly the admitted: the grant's unused entries taken back
        assert await store.r.zcard(cc_key) == 0  # its free slots dropped, and no request holds one
        level = float(await store.r.hget(t_key, "l"))
        assert 10_000_000 - 21 * 7 <= level <= 10_000_000  # what the requests used (7 each), within the refill
        rows = await store.usage(key.hash)
        assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [(21, 63, 84)]
    finally:
        await store.close()


async def test_an_rpm_limit_hammered_through_two_replicas_with_grants_admits_exactly_the_limit(redis_server):
    prefix = "g" + secrets.token_hex(4)
    a, b = await _loaded(redis_server.url, prefix), await _loaded(redis_server.url, prefix)
    key = _key(rate_limit_rpm=1_000)
    try:
        admitted = 0
        granted = 0
        for _ in range(40):  # 1,600 asked for, 40 at a time, both replicas at once
            got = await asyncio.gather(*[(a if i % 2 else b).admit(key, MODEL, 0, None) for i in range(40)])
            ok = [g for g in got if not isinstance(g, Refusal)]
            admitted += len(ok)
            granted += sum(g.grant is not None for g in ok)
            assert admitted <= 1_000
        assert granted > 500  # most from grants
        for s in (a, b):
            s.end_grants()
            await s.flush()
        # what the grants held back is back: the minute's remainder, if any, can still be admitted, and no more
        while not isinstance(await a.admit(key, MODEL, 0, None), Refusal):
            admitted += 1
        assert admitted == 1_000
    finally:
        await a.close()
        await b.close()


async def test_a_concurrency_cap_holds_over_two_replicas_with_grants_and_slots_in_use_at_a_grants_end_become_leases(redis_server):
    prefix = "g" + secrets.token_hex(4)
    a, b = await _loaded(redis_server.url, prefix), await _loaded(redis_server.url, prefix)
    key = _key(max_concurrent=64)
    try:
        held = []
        for _ in range(10):  # 100 asked for, none settled: never more than 64 in flight
            got = await asyncio.gather(*[(a if i % 2 else b).admit(key, MODEL, 0, None) for i in range(10)])
            held += [g for g in got if not isinstance(g, Refusal)]
            assert len(held) <= 64
        assert any(h.grant is not None for h in held)
        for s in (a, b):
            s.end_grants()
            await s.flush()
        while not isinstance(adm := await a.admit(key, MODEL, 0, None), Refusal):
            held.append(adm)
        assert len(held) == 64
        cc_key = a._names(key)[2]
        assert await a.r.zcard(cc_key) == 64
        in_grant = [h for h in held if h.grant is not None]
        owner = {id(h): (a if h.lease in a._leases else b) for h in in_grant}
        assert all(h.lease in owner[id(h)]._leases for h in in_grant)  # renewed by its replica's heartbeat
        for h in held:
            (owner.get(id(h)) or (a if h.lease in a._leases else b)).settle(h, _Outcome())
        for s in (a, b):
            await s.flush()
        assert await a.r.zcard(cc_key) == 0  # each dropped at its settle
        assert not a._leases and not b._leases
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("limits, why", [
    ({"rate_limit_rpm": 60}, "60 rpm: an eighth is under 8 requests"),
    ({"max_concurrent": 10}, "10 concurrent: an eighth is under 2 slots"),
    ({"rate_limit_tpm": 10_000}, "10,000 tpm: an eighth is under 8 requests of 1,015 tokens"),
    ({"rate_limit_rpm": 100_000, "max_concurrent": 10}, "one of its limits is near"),
], ids=["rpm", "concurrency", "tpm", "any-limit"])
async def test_a_key_near_a_limit_is_decided_in_redis_request_by_request(redis_server, limits, why):
    store = await _loaded(redis_server.url)
    key = _key(**limits)
    try:
        for _ in range(5):
            adm = await store.admit(key, MODEL, 5, 10 if "rate_limit_tpm" not in limits else 1_010)
            assert not isinstance(adm, Refusal) and adm.grant is None, why
            store.settle(adm, _Outcome())
        assert not store._grants
    finally:
        await store.close()


async def test_a_key_past_half_its_budget_gets_no_grant(redis_server):
    store = await _loaded(redis_server.url)
    fresh = _key(budget_tokens=1_000_000, budget_period="total")
    half = _key(budget_tokens=1_000_000, budget_period="total")
    try:
        await store.r.set(store._budget_key(half), 500_000)
        for key, expect in ((fresh, True), (half, False)):
            adm = await _second(store, key, 5, 10)
            assert not isinstance(adm, Refusal) and (adm.grant is not None) is expect
    finally:
        await store.close()


async def test_an_edited_key_drops_its_grant_and_the_new_limits_decide(redis_server):
    import dataclasses

    store = await _loaded(redis_server.url)
    key = _key(rate_limit_rpm=100_000)
    try:
        assert (await _second(store, key)).grant is not None
        edited = dataclasses.replace(key, rate_limit_rpm=50)  # a new object, as a key change makes
        adm = await store.admit(edited, MODEL, 0, None)
        assert not isinstance(adm, Refusal) and adm.grant is None
        assert dict(adm.headers)[b"x-ratelimit-limit-requests"] == b"50"
    finally:
        await store.close()


async def test_a_grant_ends_on_its_own_and_gives_back_what_it_did_not_use(redis_server):
    store = _store(redis_server.url, "g" + secrets.token_hex(4), grant_seconds=0.2)
    await store.start()
    key = _key(rate_limit_rpm=100_000, max_concurrent=1_000)
    try:
        adm = await _second(store, key)
        assert adm.grant is not None
        store.settle(adm, _Outcome())
        r_key, _, cc_key, _ = store._names(key)
        assert await store.r.llen(r_key) > 2  # the grant's entries count from the start
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not store._grants and not store._pending and await store.r.llen(r_key) == 2:
                break
        assert await store.r.llen(r_key) == 2 and await store.r.zcard(cc_key) == 1  # the first one's lease, never settled
    finally:
        await store.close()


async def test_a_grant_is_renewed_before_it_runs_out(redis_server):
    store = await _loaded(redis_server.url)
    key = _key(rate_limit_rpm=100_000)
    try:
        first = (await _second(store, key)).grant
        assert first is not None and first.granted == 32
        for _ in range(40):
            adm = await store.admit(key, MODEL, 0, None)
            assert adm.grant is not None  # never back to Redis: the next came before this one ran out
            await asyncio.sleep(0.01)  # requests a round trip apart
        assert first.ended and store._grants[key.hash] is not first
    finally:
        await store.close()



@pytest.mark.parametrize("tail", [
    [32, 0, 0, b"99", b"0", 0, 1],  # no slots for a key with a concurrency cap: would read as no cap
    [10**6, 0, 16, b"99", b"0", 0, 1],  # more requests than were asked for
    [32, 0, 16, b"inf", b"0", 0, 1],  # a level that is not finite
    [b"many", 0, 16, b"99", b"0", 0, 1],  # not a number
], ids=["no-slots", "more-than-asked", "infinite", "not-a-number"])
async def test_a_grant_redis_did_not_make_is_not_taken(redis_server, tail):
    # Redis is not trusted: a grant reply outside what was asked, or that is not ADMIT's, makes no grant
    # (the admission itself stands, as its own 6 values say).
    store = await _loaded(redis_server.url)
    key = _key(rate_limit_rpm=100_000, max_concurrent=1_000)

    def request(packed: bytes, n: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result([[1, b"", 0, b"99", b"-1", 0] + tail] * n)
        return fut

    store.pipe.request = request  # type: ignore[method-assign]
    try:
        first = await store.admit(key, MODEL, 0, None)
        assert not isinstance(first, Refusal) and first.shared
        assert not store._grants
        assert (await store.admit(key, MODEL, 0, None)).grant is None
    finally:
        await store.close()
