"""A Redis outage loses no usage: what a replica spends while Redis is down (admitted by its local
fallback) reaches Redis's usage counters and the key's budget once Redis is back; a queue that
overflows drops its oldest settles and says so. Real redis-server, real gateway, real simulator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

import httpx
import pytest

from gateway.cli import main as cli_main
from gateway.config import ApiKeyConfig, parse_config
from gateway.state.keys import hash_key, new_key
from gateway.metrics import REGISTRY
from gateway.state.limits import period_id
from gateway.state.redis import RedisStore
from support import GatewayServer, Sim, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"


def _chat(gw: GatewayServer, key: str, i: int) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me " + "x" * (7 * i + 1)}], "max_tokens": 3 + i}
    return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body, timeout=10)


def _flush(gw: GatewayServer) -> None:
    asyncio.run_coroutine_threadsafe(gw.gateway.store.flush(), gw.gateway.store.loop).result(5)


def test_tokens_spent_during_an_outage_reach_redis_usage_and_the_budget(keys, tmp_path, capsys):
    from redisd import RedisServer

    prefix = "o" + secrets.token_hex(4)
    secret = new_key()
    entry = {"name": "budgeted", "hash": hash_key(secret), "budget_tokens": 1_000_000, "budget_period": "day", "rate_limit_rpm": 1000}
    with RedisServer() as redis, Sim(MODEL, "--ttft", "0", "--tpot", "0", api_key="backend-secret") as sim:
        state = {"redis_url": redis.url, "prefix": prefix, "timeout": 0.2}
        cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}], state=state)
        cfg["auth"] = {"keys": keys.entries + [entry]}
        cfg_file = tmp_path / "gw.yaml"
        cfg_file.write_text(json.dumps({**cfg, "backends": [{"url": "http://127.0.0.1:9"}]}))
        with GatewayServer(cfg) as gw:
            start = sim.stats()
            for i in range(3):  # before the outage: counted in Redis as usual
                assert _chat(gw, secret, i).status_code == 200
            _flush(gw)
            redis.save()
            redis.stop()
            for i in range(3, 8):  # during it: admitted by the fallback from the local key cache
                assert _chat(gw, secret, i).status_code == 200
            # waiting, not lost (a request's settle is recorded as its handler ends, a moment after
            # the client has read the answer: waited for, not read at once)
            wait_until(lambda: gw.gateway.store.degraded and len(gw.gateway.store._pending) >= 5, 5, 0.05, "degraded, 5 settles waiting")
            end = sim.stats()
            redis.start()  # the same data as before the outage (saved), plus nothing of the outage yet
            wait_until(lambda: not gw.gateway.store.degraded and not gw.gateway.store._pending, 15, 0.05, "recovery and the queue applied")

        prompt = end["prompt_tokens"] - start["prompt_tokens"]
        completion = end["generation_tokens"] - start["generation_tokens"]
        assert prompt > 0 and completion > 0
        assert cli_main(["usage", "--config", str(cfg_file), "--key", "budgeted", "--since", "1h", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"], r["estimated_requests"]) for r in rows] == [(8, prompt, completion, 0)]
        import redis as redis_py

        r = redis_py.Redis.from_url(redis.url, socket_timeout=2)
        try:
            budget = int(r.get(f"{prefix}:bud:{hash_key(secret)[7:]}:{period_id('day')}"))
        finally:
            r.close()
        assert budget == prompt + completion  # the outage's tokens are charged to the budget too


def test_an_overflowing_queue_drops_the_oldest_settles_counts_them_and_warns(caplog):
    from redisd import RedisServer

    key = ApiKeyConfig(name="k", hash=hash_key(new_key()), budget_tokens=10_000, budget_period="total")

    def dropped() -> float:
        return REGISTRY.get_sample_value("gateway_state_settles_dropped_total") or 0.0

    async def run(url: str, redis: RedisServer) -> None:
        cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                            "state": {"redis_url": url, "prefix": "d" + secrets.token_hex(4), "timeout": 0.2}})
        store = RedisStore(cfg)
        store.max_pending = 3
        await store.start()
        try:
            redis.stop()
            before = dropped()
            with caplog.at_level(logging.WARNING, logger="gateway.state.redis"):
                for n in range(1, 6):  # five requests of 10, 20, ... 50 tokens; the queue keeps three
                    adm = await store.admit(key, MODEL, 1, 1)
                    store.settle(adm, type("Outcome", (), {"ok": True, "prompt_tokens": n * 10, "completion_tokens": 0})())
                    await asyncio.sleep(0.05)
            assert dropped() - before == 2
            assert any("settles_dropped" in r.getMessage() for r in caplog.records)
            redis.start()
            deadline = time.monotonic() + 10
            while store._pending or store.degraded:
                assert time.monotonic() < deadline, "the queue was never applied"
                await asyncio.sleep(0.05)
            # An empty queue may be one taken by a flush whose call is still in flight (the scripts are
            # loaded again first, on a new Redis): its usage is waited for.
            while not (rows := await store.usage(key.hash)):
                assert time.monotonic() < deadline, "the queue was never applied"
                await asyncio.sleep(0.05)
            assert [(r.requests, r.prompt_tokens) for r in rows] == [(3, 30 + 40 + 50)]  # the newest three
            assert int(await store.r.get(store._budget_key(key))) == 120
        finally:
            await store.close()

    with RedisServer() as redis:
        asyncio.run(run(redis.url, redis))
