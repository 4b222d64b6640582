"""Settles folded into SETTLE_MANY calls (gateway/state/settle.py) count exactly what settling them
one by one would, against the real redis-server: usage, budget, leases and the tpm bucket's order."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from gateway.config import ApiKeyConfig, parse_config
from gateway.errors import Refusal
from gateway.state.keys import hash_key, new_key
from gateway.state.redis import RedisStore
from gateway.state.settle import CHUNK, Settle, settle_calls

pytestmark = pytest.mark.e2e  # a real redis-server

MODEL = "m"


class _Outcome:
    ok = True

    def __init__(self, prompt: int | None, completion: int) -> None:
        self.prompt_tokens = prompt
        self.completion_tokens = completion


def _store(url: str) -> RedisStore:
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        # every admission decided in Redis: these tests read its per-request effects (grants: test_state_grants.py)
                        "state": {"redis_url": url, "prefix": "s" + secrets.token_hex(4), "timeout": 1.0, "grant_seconds": 0}})
    return RedisStore(cfg)


async def test_more_settles_than_one_call_carries_count_exactly(redis_server):
    store = _store(redis_server.url)
    await store.start()
    a = ApiKeyConfig(name="a", hash=hash_key(new_key()), rate_limit_tpm=10_000_000, max_concurrent=10_000,
                     budget_tokens=10**9, budget_period="day")
    b = ApiKeyConfig(name="b", hash=hash_key(new_key()), budget_tokens=10**9, budget_period="total")
    try:
        expect: dict[str, list[int]] = {a.hash: [0, 0, 0, 0], b.hash: [0, 0, 0, 0]}  # requests, prompt, completion, estimated
        n = CHUNK * 2 + 37  # three calls' worth
        admissions = []
        for i in range(n):
            key = a if i % 3 else b
            adm = await store.admit(key, MODEL, 5, 10)
            assert not isinstance(adm, Exception) and adm.shared, adm
            admissions.append((key, adm))
        assert await store.r.zcard(store._lease_key(a)) == sum(1 for k, _ in admissions if k is a)
        for i, (key, adm) in enumerate(admissions):
            prompt = None if i % 11 == 0 else 3  # no usage in the response: the estimate (5), flagged
            store.settle(adm, _Outcome(prompt, i % 7))
            e = expect[key.hash]
            e[0] += 1
            e[1] += 5 if prompt is None else prompt
            e[2] += i % 7
            e[3] += prompt is None
        await store.flush()
        rows = {r.key_hash: [r.requests, r.prompt_tokens, r.completion_tokens, r.estimated] for r in await store.usage()}
        assert rows == expect
        for key in (a, b):
            assert int(await store.r.get(store._budget_key(key))) == expect[key.hash][1] + expect[key.hash][2]
        assert await store.r.zcard(store._lease_key(a)) == 0  # every lease dropped
    finally:
        await store.close()


async def test_a_buckets_amounts_are_applied_in_order_with_the_cap_after_each(redis_server):
    # Bucket 5 below its cap: +10 then -3 leaves it 3 below the cap (capped after the +10), where a
    # summed +7 would leave it full: a stream that ran over must still take its tokens.
    store = _store(redis_server.url)
    await store.start()
    try:
        tpm = 600  # refills 0.01 token a millisecond: the script's few milliseconds stay under the cap's effect
        bucket = f"{store.cfg.prefix}:rl:x:t".encode()
        sec, usec = await store.r.time()
        await store.r.hset(bucket, mapping={"l": tpm - 5, "t": sec * 1000 + usec // 1000})

        def settle(back: int) -> Settle:
            return Settle(bucket, tpm, back, b"", "", b"", 0, -1, b"", "", 0, 0, False, False, 0)

        calls = settle_calls([settle(10), settle(-3)])
        assert len(calls) == 1
        results = await store._eval_many("settle", [(store._settle_many, keys, args) for keys, args, _ in calls])
        assert results == [1]
        assert float(await store.r.hget(bucket, "l")) == tpm - 3
    finally:
        await store.close()


@pytest.mark.parametrize("n", [0, 1, CHUNK, CHUNK + 1])
def test_settles_are_split_into_calls_of_at_most_a_chunk(n: int):
    s = Settle(b"t", 0, 0, b"cc", "l", b"", 0, -1, b"u", "h|m", 1, 1, False, True, 60)
    calls: list[tuple[list[bytes], list[Any], list[Settle]]] = settle_calls([s] * n)
    assert [len(carried) for _, _, carried in calls] == [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])


async def test_settles_ride_on_the_next_admission_and_go_alone_only_when_none_comes(redis_server):
    """A settle waits for the next admission's write (one write for both); only one that waited
    ``flush_every`` for none is sent on its own, and then it is counted all the same."""
    import asyncio

    store = _store(redis_server.url)
    store.flush_every = store.flush_usage_every = 0.3  # longer than any gap between this loop's admissions
    await store.start()
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), rate_limit_tpm=10_000_000, max_concurrent=10_000)
    alone = 0
    eval_many = store._eval_many

    async def counting(op: str, calls: Any) -> list[Any]:
        nonlocal alone
        alone += op == "settle"
        return await eval_many(op, calls)

    store._eval_many = counting  # type: ignore[method-assign]  # counts, and runs the real call
    try:
        n = 40
        for _ in range(n):
            adm = await store.admit(key, MODEL, 5, 10)
            assert not isinstance(adm, Exception) and adm.shared, adm
            store.settle(adm, _Outcome(3, 2))
            await asyncio.sleep(0.002)
        assert alone == 0  # every settle but the last rode on an admission
        for _ in range(100):  # the last goes alone, within flush_every
            if alone:
                break
            await asyncio.sleep(0.02)
        assert alone == 1 and not store._pending
        rows = await store.usage(key.hash)
        assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [(n, 3 * n, 2 * n)]
        assert await store.r.zcard(store._lease_key(key)) == 0
    finally:
        await store.close()


async def test_a_settle_that_only_counts_waits_longer_to_go_alone_than_one_that_drops_a_lease(redis_server):
    """Usage, tokens back and budget can wait (flush_usage_every: fewer writes of their own when
    grants keep admissions off Redis); a lease to drop goes within flush_every, taking the rest along."""
    import asyncio

    store = _store(redis_server.url)
    store.flush_every, store.flush_usage_every = 0.01, 30.0
    await store.start()
    counts = ApiKeyConfig(name="c", hash=hash_key(new_key()), rate_limit_tpm=10_000_000)
    leased = ApiKeyConfig(name="l", hash=hash_key(new_key()), max_concurrent=10_000)
    try:
        adm = await store.admit(counts, MODEL, 5, 10)
        store.settle(adm, _Outcome(3, 2))
        await asyncio.sleep(0.2)
        assert len(store._pending) == 1  # still waiting: nothing urgent
        adm = await store.admit(leased, MODEL, 5, 10)  # this admission's write carried the first settle
        assert not store._pending
        store.settle(adm, _Outcome(3, 2))
        for _ in range(100):
            if not store._pending:
                break
            await asyncio.sleep(0.01)
        assert not store._pending and await store.r.zcard(store._lease_key(leased)) == 0  # gone alone, in time
        assert [r.requests for r in await store.usage()] == [1, 1]
    finally:
        await store.close()


async def _scripts(store: RedisStore) -> int:
    """Scripts Redis has run so far (INFO commandstats: EVALSHA calls, as bench/overhead.py reads them)."""
    return (await store.r.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)


async def _loaded(url: str) -> RedisStore:
    """A store with its scripts loaded and no background task: settles reach Redis only with an
    admission or ``flush()``, and no heartbeat renews a lease between two readings of the stats."""
    store = _store(url)
    await store._load_scripts()
    return store


def _remaining_tokens(adm: Any) -> int:
    return int(dict(adm.headers)[b"x-ratelimit-remaining-tokens"])


async def test_an_admission_carries_the_waiting_settles_in_its_one_script_call_and_they_count_first(redis_server):
    # 5 requests hold the key's 5 leases and 50,000 of its 60,000 tokens; they end (settles waiting), and
    # the next admission's one script call settles them, then admits it: their leases and the 9,900
    # tokens each gives back already count for it, and usage and budget are exact.
    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), rate_limit_rpm=100, rate_limit_tpm=60_000, max_concurrent=5,
                       budget_tokens=10**9, budget_period="day")
    try:
        held = [await store.admit(key, MODEL, 0, 10_000) for _ in range(5)]
        assert all(not isinstance(adm, Exception) and adm.shared for adm in held), held
        for i, adm in enumerate(held):
            store.settle(adm, _Outcome(40 + i, 60))  # used 100 + i of the 10,000 reserved
        assert len(store._pending) == 5
        before = await _scripts(store)
        adm = await store.admit(key, MODEL, 0, 10_000)
        assert await _scripts(store) - before == 1  # one script call for the settles and the admission
        assert not isinstance(adm, Refusal), adm.message  # the ended requests' leases were dropped first
        assert not store._pending
        used = sum(100 + i for i in range(5))
        # The bucket: 60,000 - 5 x 10,000 + (50,000 - used) given back - 10,000, plus what refilled
        # meanwhile (1 token a ms) up to the cap; settled after the admission it would be ~0.
        assert 50_000 - used <= _remaining_tokens(adm) <= 50_000
        assert int(dict(adm.headers)[b"x-ratelimit-remaining-requests"]) == 100 - 6
        assert await store.r.zcard(store._lease_key(key)) == 1  # the new admission's only
        assert int(await store.r.get(store._budget_key(key))) == used
        rows = await store.usage(key.hash)
        assert [(r.requests, r.prompt_tokens, r.completion_tokens, r.estimated) for r in rows] == [(5, sum(40 + i for i in range(5)), 300, 0)]
    finally:
        await store.close()


async def test_an_admission_carries_at_most_a_chunk_of_settles_and_the_rest_go_alone_in_the_same_write(redis_server):
    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), max_concurrent=10_000, budget_tokens=10**9, budget_period="total")
    try:
        n = CHUNK * 2 + 37
        held = [await store.admit(key, MODEL, 5, 10) for _ in range(n)]
        for adm in held:
            store.settle(adm, _Outcome(3, 2))
        before = await _scripts(store)
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal) and adm.shared
        assert await _scripts(store) - before == 3  # the admission with CHUNK settles, then two SETTLE_MANY calls
        assert not store._pending
        rows = await store.usage(key.hash)
        assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [(n, 3 * n, 2 * n)]
        assert int(await store.r.get(store._budget_key(key))) == 5 * n
        assert await store.r.zcard(store._lease_key(key)) == 1
    finally:
        await store.close()


async def test_a_carrying_call_that_fails_drops_its_settles_and_its_admission_is_asked_again_alone(redis_server):
    # This hour's usage hash is not a hash (someone else's write): the settle part of the call fails
    # (WRONGTYPE), after the leases were dropped. The admission is still answered by Redis, its own.
    from gateway.state import stats

    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), max_concurrent=2)
    usage_key = b""
    try:
        held = [await store.admit(key, MODEL, 5, 10) for _ in range(2)]
        for adm in held:
            store.settle(adm, _Outcome(3, 2))
        usage_key = store._pending[0].usage_key
        await store.r.set(usage_key, "not a hash")
        errors = stats.STATE_ERRORS.labels(op="settle")._value.get()
        before = await _scripts(store)
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal) and adm.shared  # Redis's answer, not the fallback's
        assert await _scripts(store) - before == 2  # the carrying call, then the admission alone
        assert stats.STATE_ERRORS.labels(op="settle")._value.get() == errors + 1
        assert not store._pending  # dropped, as a failed SETTLE_MANY call's are
        assert await store.r.zcard(store._lease_key(key)) == 1
    finally:
        if usage_key:
            await store.r.delete(usage_key)
        await store.close()


async def test_settles_carried_to_a_redis_that_lost_its_scripts_are_kept_and_counted_once(redis_server):
    # A restarted Redis (here: SCRIPT FLUSH) answers NOSCRIPT: none of the call ran, so its settles wait
    # again and the admission is asked again once the scripts are loaded.
    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), max_concurrent=10, budget_tokens=10**9, budget_period="total")
    try:
        held = [await store.admit(key, MODEL, 5, 10) for _ in range(3)]
        for adm in held:
            store.settle(adm, _Outcome(3, 2))
        await store.r.script_flush()
        adm = await store.admit(key, MODEL, 5, 10)
        assert not isinstance(adm, Refusal) and adm.shared
        assert len(store._pending) == 3
        await store.flush()
        rows = await store.usage(key.hash)
        assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [(3, 9, 6)]
        assert int(await store.r.get(store._budget_key(key))) == 15
        assert await store.r.zcard(store._lease_key(key)) == 1
    finally:
        await store.close()


async def test_one_keys_admissions_in_one_turn_share_one_call_and_are_decided_in_order(redis_server):
    # 12 admissions of one key asked for together: one ADMIT call decides them in the order they came,
    # each by the rules it would meet alone: 7 rpm, 5 leases, a tpm bucket of 1,000 with 300 a request.
    import asyncio

    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), rate_limit_rpm=7, max_concurrent=5)
    tokens = ApiKeyConfig(name="t", hash=hash_key(new_key()), rate_limit_tpm=1_000)
    try:
        before = await _scripts(store)
        got = await asyncio.gather(*[store.admit(key, MODEL, 0, None) for _ in range(12)])
        assert await _scripts(store) - before == 1  # one call for the twelve
        admitted = [not isinstance(a, Refusal) for a in got]
        assert admitted == [True] * 5 + [False] * 7  # the first five, in order: then the lease set is full
        assert all(a.reason == "concurrency_limited" for a in got[5:])
        # requests left after each admitted one, counted down in order
        assert [int(dict(a.headers)[b"x-ratelimit-remaining-requests"]) for a in got[:5]] == [6, 5, 4, 3, 2]
        assert await store.r.zcard(store._lease_key(key)) == 5
        assert await store.r.llen(store._names(key)[0]) == 5  # only the admitted are in the rpm log
        for a in got[:5]:
            store.settle(a, _Outcome(1, 1))
        # the leases back: now the rpm limit refuses the third of three (5 + 2 = 7 in the minute)
        again = await asyncio.gather(*[store.admit(key, MODEL, 0, None) for _ in range(3)])
        assert [not isinstance(a, Refusal) for a in again] == [True, True, False]
        assert again[2].reason == "rate_limited" and dict(again[2].headers).get(b"retry-after")

        before = await _scripts(store)
        got = await asyncio.gather(*[store.admit(tokens, MODEL, 100, 200) for _ in range(4)], store.admit(key, MODEL, 0, None))
        assert await _scripts(store) - before == 2  # one call per key
        assert [not isinstance(a, Refusal) for a in got[:4]] == [True, True, True, False]
        assert got[3].reason == "token_rate_limited"
        assert [_remaining_tokens(a) for a in got[:3]] == [700, 400, 100]  # within the refill of a few ms
    finally:
        await store.close()


async def test_admissions_past_a_call_s_group_go_in_further_calls_of_the_same_write(redis_server):
    import asyncio

    from gateway.state.redis import GROUP

    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), rate_limit_rpm=GROUP + 10)
    try:
        before = await _scripts(store)
        got = await asyncio.gather(*[store.admit(key, MODEL, 0, None) for _ in range(GROUP + 12)])
        assert await _scripts(store) - before == 2
        assert [not isinstance(a, Refusal) for a in got] == [True] * (GROUP + 10) + [False] * 2
        assert int(dict(got[GROUP + 9].headers)[b"x-ratelimit-remaining-requests"]) == 0
    finally:
        await store.close()


NO_GRANT = [0, 0, 0, b"0", b"0", 0, 0]  # ADMIT's 7 grant values when none was asked for


@pytest.mark.parametrize("reply", [
    [1, b"", 0, b"5", b"7"] + NO_GRANT,  # one value short
    [1, b"", 0, b"5", b"7", 0],  # no grant values
    [[1], b"", 0, b"5", b"7", 0] + NO_GRANT,  # a nested list where the flag goes
    [1, b"", b"soon", b"5", b"7", 0] + NO_GRANT,  # a retry that is not a number
    [1, b"", 0, b"inf", b"7", 0] + NO_GRANT,  # requests left not finite: the headers could not show it
    [1, b"", 0, b"5", b"nan", 0] + NO_GRANT,  # tokens left not a number
    b"OK",  # not a list at all
], ids=["short", "no-grant-part", "nested", "not-a-number", "infinite", "nan", "not-a-list"])
async def test_an_admit_reply_of_the_wrong_shape_is_not_trusted_the_fallback_decides(redis_server, reply):
    # Redis is not trusted: whatever it answers, the request gets a decision (the local fallback's,
    # within the per-replica share), never an exception, and the failure is counted.
    import asyncio

    from gateway.state import stats

    store = await _loaded(redis_server.url)
    key = ApiKeyConfig(name="a", hash=hash_key(new_key()), rate_limit_rpm=2)

    def request(packed: bytes, n: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result([reply] * n)
        return fut

    store.pipe.request = request  # type: ignore[method-assign]
    errors = stats.STATE_ERRORS.labels(op="admit")._value.get()
    try:
        got = [await store.admit(key, MODEL, 0, None) for _ in range(3)]
        assert [isinstance(a, Refusal) for a in got] == [False, False, True]  # the fallback's rpm of 2
        assert all(not a.shared for a in got[:2])
        assert stats.STATE_ERRORS.labels(op="admit")._value.get() >= errors + 3
    finally:
        await store.close()
