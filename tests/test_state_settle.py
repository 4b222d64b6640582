"""Settles folded into SETTLE_MANY calls (gateway/state/settle.py) count exactly what settling them
one by one would, against the real redis-server: usage, budget, leases and the tpm bucket's order."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from gateway.config import ApiKeyConfig, parse_config
from gateway.filters.auth import hash_key, new_key
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
                        "state": {"redis_url": url, "prefix": "s" + secrets.token_hex(4), "timeout": 1.0}})
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
    store.flush_every = 0.3  # longer than any gap between this loop's admissions
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
