"""The shared state layer against a real redis-server: two gateway replicas, one Redis, real sims.

Keys are created and revoked with the real CLI (``gateway keys ... --redis-url``); every test
uses its own key prefix in Redis, so they do not see each other's keys or counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
from typing import Any, Iterator

import httpx
import pytest

from gateway.cli import main as cli_main
from gateway.state.keys import hash_key, new_key
from support import GatewayServer, Sim, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
MSG = [{"role": "user", "content": "hello there, how are you today?"}]


def _cli(capsys, *argv: str) -> str:
    rc = cli_main(list(argv))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def _secret_of(out: str) -> str:
    return next(line.strip() for line in out.splitlines() if line.strip().startswith("sk-"))


@contextlib.contextmanager
def replicas(keys, redis_url: str, prefix: str, n: int = 2, sim_args: tuple[str, ...] = (), **state: Any) -> Iterator[tuple[list[GatewayServer], Sim]]:
    with Sim(MODEL, *sim_args, api_key="backend-secret") as sim:
        cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}],
                             state={"redis_url": redis_url, "prefix": prefix, **state})
        gws: list[GatewayServer] = []
        try:
            for _ in range(n):
                gws.append(GatewayServer(cfg))
            yield gws, sim
        finally:
            for g in gws:
                g.stop()


def _chat(gw: GatewayServer, key: str, client: httpx.Client | None = None, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, **extra}
    c = client or httpx
    return c.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body, timeout=10)


@pytest.fixture
def prefix() -> str:
    return "t" + secrets.token_hex(4)


def test_a_created_key_works_on_every_replica_and_a_revoked_one_is_refused_within_a_second(keys, redis_server, prefix, capsys):
    url = redis_server.url
    with replicas(keys, url, prefix) as (gws, _):
        a, b = gws
        # Create through replica a's store; replica b learns it by pub/sub.
        store = a.gateway.store
        secret = new_key()
        from gateway.config import ApiKeyConfig

        asyncio.run_coroutine_threadsafe(store.put_key(ApiKeyConfig(name="carol", hash=hash_key(secret))), _loop_of(a)).result(5)
        digest = bytes.fromhex(hash_key(secret)[7:])
        # What auth reads on replica b (its local cache) has the key within a second ...
        wait_until(lambda: b.gateway.store.keys.lookup(digest) is not None, 1.0, 0.005, "the new key in the other replica's cache")
        assert _chat(b, secret).status_code == 200  # ... and the key works there
        assert _chat(a, secret).status_code == 200

        # Revoke through replica a's store; replica b refuses within a second.
        from dataclasses import replace

        key = store.keys.lookup(bytes.fromhex(hash_key(secret)[7:]))
        asyncio.run_coroutine_threadsafe(store.put_key(replace(key, disabled=True)), _loop_of(a)).result(5)
        wait_until(lambda: b.gateway.store.keys.lookup(digest).disabled, 1.0, 0.005, "the revocation in the other replica's cache")
        assert _chat(b, secret).status_code == 401
        r = _chat(a, secret)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def _loop_of(gw: GatewayServer) -> asyncio.AbstractEventLoop:
    """The event loop uvicorn runs the gateway on (the store's client belongs to it)."""
    return gw.gateway.store.loop  # type: ignore[attr-defined]


def test_the_cli_manages_keys_in_redis_and_replicas_follow(keys, redis_server, prefix, tmp_path, capsys):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"auth": {"keys": keys.entries}, "backends": [{"url": "http://127.0.0.1:9"}],
                               "state": {"redis_url": redis_server.url, "prefix": prefix}}))
    with replicas(keys, redis_server.url, prefix) as (gws, _):
        a, b = gws
        secret = _secret_of(_cli(capsys, "keys", "create", "--config", str(cfg), "--name", "dave", "--rpm", "100", "--models", MODEL))
        digest = bytes.fromhex(hash_key(secret)[7:])

        def on_both(check) -> bool:  # what auth reads on each replica: its local key cache
            return all((k := g.gateway.store.keys.lookup(digest)) is not None and check(k) for g in gws)

        wait_until(lambda: on_both(lambda k: True), 1.0, 0.005, "dave on both")
        assert _chat(a, secret).status_code == 200 and _chat(b, secret).status_code == 200
        listed = json.loads(_cli(capsys, "keys", "list", "--config", str(cfg), "--json"))
        assert [(r["name"], r["status"], r["rpm"], r["models"]) for r in listed] == [("dave", "active", 100, [MODEL])]
        _cli(capsys, "keys", "update", "dave", "--config", str(cfg), "--models", "other-model")
        # The key may no longer use the model: the same 404 as an unknown model.
        wait_until(lambda: on_both(lambda k: k.models == ("other-model",)), 1.0, 0.005, "the model list change on both")
        assert _chat(b, secret).status_code == 404
        _cli(capsys, "keys", "revoke", listed[0]["id"], "--config", str(cfg))
        wait_until(lambda: on_both(lambda k: k.disabled), 1.0, 0.005, "revoked on both")
        assert _chat(a, secret).status_code == 401 and _chat(b, secret).status_code == 401
        assert "revoked" in _cli(capsys, "keys", "show", "dave", "--config", str(cfg))
        # A name that would inject YAML or a second entry is refused before anything is stored.
        assert cli_main(["keys", "create", "--config", str(cfg), "--name", "x\nadmin: true"]) == 2
        assert "not valid" in capsys.readouterr().err


def _hammer(gws: list[GatewayServer], key: str, n: int, **extra: Any) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=64)) as c:
            async def one(i: int) -> httpx.Response:
                gw = gws[i % len(gws)]
                return await c.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                    json={"model": MODEL, "messages": MSG, "max_tokens": 1, **extra})
            return list(await asyncio.gather(*(one(i) for i in range(n))))

    return asyncio.run(run())


def _with_key(keys, **fields: Any) -> tuple[Any, str]:
    secret = new_key()
    entry = {"name": "limited", "hash": hash_key(secret), **fields}
    k = type(keys).__new__(type(keys))
    k.alice, k.bob, k.entries = keys.alice, keys.bob, keys.entries + [entry]
    return k, secret


def test_60_rpm_through_two_replicas_admits_60_or_61(keys, redis_server, prefix):
    k, secret = _with_key(keys, rate_limit_rpm=60)
    with replicas(k, redis_server.url, prefix, sim_args=("--ttft", "0", "--tpot", "0")) as (gws, sim):
        responses = _hammer(gws, secret, 150)
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert len(ok) + len(refused) == 150
        assert len(ok) in (60, 61), len(ok)
        r = refused[0]
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == "60"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-reset-requests" in r.headers
        h = ok[0].headers  # successful responses carry the same headers
        assert h["x-ratelimit-limit-requests"] == "60" and int(h["x-ratelimit-remaining-requests"]) < 60


def test_tpm_is_not_overshot_by_concurrent_streams(keys, redis_server, prefix):
    tpm = 600
    k, secret = _with_key(keys, rate_limit_tpm=tpm)
    with replicas(k, redis_server.url, prefix, sim_args=("--ttft", "0.2", "--tpot", "0.01")) as (gws, sim):
        before = sim.stats()
        responses = _hammer(gws, secret, 24, stream=True, max_tokens=100, stream_options={"include_usage": True})
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert ok and refused and len(ok) + len(refused) == 24
        after = sim.stats()
        used = (after["prompt_tokens"] - before["prompt_tokens"]) + (after["generation_tokens"] - before["generation_tokens"])
        assert used <= tpm, f"{len(ok)} streams used {used} tokens against a limit of {tpm}/min"
        assert refused[0].headers["x-ratelimit-limit-tokens"] == str(tpm)
        assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"


def test_usage_counts_match_the_simulators_record(keys, redis_server, prefix, capsys, tmp_path):
    k, secret = _with_key(keys)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"auth": {"keys": k.entries}, "backends": [{"url": "http://127.0.0.1:9"}],
                               "state": {"redis_url": redis_server.url, "prefix": prefix}}))
    with replicas(k, redis_server.url, prefix, sim_args=("--ttft", "0", "--tpot", "0")) as (gws, sim):
        before = sim.stats()
        for i in range(12):
            gw = gws[i % 2]
            if i % 3 == 0:
                r = _chat(gw, secret, max_tokens=5 + i, stream=True, stream_options={"include_usage": True})
            else:
                r = _chat(gw, secret, max_tokens=5 + i, messages=[{"role": "user", "content": "x" * (10 * i + 1)}])
            assert r.status_code == 200
        after = sim.stats()
        for g in gws:
            asyncio.run_coroutine_threadsafe(g.gateway.store.flush(), _loop_of(g)).result(5)
        rows = json.loads(_cli(capsys, "usage", "--config", str(cfg), "--key", hash_key(secret), "--since", "1h", "--json"))
        assert [(r["model"], r["requests"], r["estimated_requests"]) for r in rows] == [(MODEL, 12, 0)]
        assert rows[0]["prompt_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
        assert rows[0]["completion_tokens"] == after["generation_tokens"] - before["generation_tokens"]
        text = gws[0].url + "/metrics"
        metrics = httpx.get(text, headers={"authorization": f"Bearer {keys.alice}"}).text
        assert 'gateway_usage_tokens_total{key="limited",kind="prompt",model="test-model"}' in metrics


def test_a_stream_without_usage_is_counted_as_an_estimate(keys, redis_server, prefix):
    k, secret = _with_key(keys)
    with replicas(k, redis_server.url, prefix, n=1, sim_args=("--ttft", "0", "--tpot", "0")) as (gws, _):
        assert _chat(gws[0], secret, stream=True, max_tokens=6).status_code == 200
        asyncio.run_coroutine_threadsafe(gws[0].gateway.store.flush(), _loop_of(gws[0])).result(5)
        rows = asyncio.run_coroutine_threadsafe(gws[0].gateway.store.usage(hash_key(secret)), _loop_of(gws[0])).result(5)
        assert rows[0].requests == 1 and rows[0].estimated == 1 and rows[0].completion_tokens > 0


def test_concurrency_cap_holds_over_replicas_and_leases_are_released(keys, redis_server, prefix):
    k, secret = _with_key(keys, max_concurrent=2)
    with replicas(k, redis_server.url, prefix, sim_args=("--ttft", "0.5", "--tpot", "0")) as (gws, _):
        responses = _hammer(gws, secret, 6)
        assert sorted(r.status_code for r in responses) == [200, 200, 429, 429, 429, 429]
        refused = next(r for r in responses if r.status_code == 429)
        assert "in flight" in refused.json()["error"]["message"] and "retry-after" in refused.headers
        # Every lease was dropped when its request ended: two at once are admitted again.
        assert sorted(r.status_code for r in _hammer(gws, secret, 2)) == [200, 200]


def test_a_lease_of_a_dead_replica_expires(keys, redis_server, prefix):
    from gateway.config import ApiKeyConfig, parse_config
    from gateway.state.redis import RedisStore

    key = ApiKeyConfig(name="k", hash=hash_key(new_key()), max_concurrent=1)
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": redis_server.url, "prefix": prefix, "lease_ttl": 3}})

    async def run() -> None:
        dead, alive = RedisStore(cfg), RedisStore(cfg)
        try:
            assert not isinstance(await dead.admit(key, MODEL, 1, 1), type(None))
            refused = await alive.admit(key, MODEL, 1, 1)
            assert getattr(refused, "status", None) == 429  # the dead replica's lease still counts
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:  # it never renews it: the lease expires after lease_ttl
                if not hasattr(await alive.admit(key, MODEL, 1, 1), "status"):
                    return
                await asyncio.sleep(0.2)
            raise AssertionError("the dead replica's lease never expired")
        finally:
            await dead.r.aclose()
            await alive.r.aclose()

    asyncio.run(run())


def test_a_spent_budget_is_refused_with_insufficient_quota(keys, redis_server, prefix):
    k, secret = _with_key(keys, budget_tokens=30, budget_period="day")
    with replicas(k, redis_server.url, prefix, sim_args=("--ttft", "0", "--tpot", "0")) as (gws, _):
        statuses = []
        for i in range(20):
            r = _chat(gws[i % 2], secret, max_tokens=8)
            statuses.append(r.status_code)
            if r.status_code == 429:
                break
            asyncio.run_coroutine_threadsafe(gws[i % 2].gateway.store.flush(), _loop_of(gws[i % 2])).result(5)
        assert statuses[-1] == 429 and statuses[:-1] and set(statuses[:-1]) == {200}
        body = r.json()["error"]
        assert body["code"] == "insufficient_quota" and body["type"] == "insufficient_quota"


def test_redis_down_keeps_known_keys_working_refuses_unknown_ones_and_recovers(keys):
    from redisd import RedisServer

    prefix = "t" + secrets.token_hex(4)
    k, limited = _with_key(keys, rate_limit_rpm=1000)
    with RedisServer() as redis, replicas(k, redis.url, prefix, sim_args=("--ttft", "0", "--tpot", "0"), timeout=0.2) as (gws, _):
        a, b = gws
        stored = new_key()
        from gateway.config import ApiKeyConfig

        asyncio.run_coroutine_threadsafe(a.gateway.store.put_key(ApiKeyConfig(name="stored", hash=hash_key(stored))), _loop_of(a)).result(5)
        wait_until(lambda: _chat(b, stored).status_code == 200, 1.0, 0.02, "stored key on b")

        redis.stop()
        with httpx.Client(timeout=5) as c:
            for gw in gws:
                for key in (keys.alice, limited, stored):  # config keys and the stored key, from the local cache
                    t0 = time.monotonic()
                    r = _chat(gw, key, c)
                    assert r.status_code == 200, r.text
                    assert time.monotonic() - t0 < 2.0
                assert _chat(gw, new_key(), c).status_code == 401  # unknown: fail closed
        wait_until(lambda: a.gateway.store.degraded and b.gateway.store.degraded, 5, 0.05, "degraded flag")
        metrics = httpx.get(a.url + "/metrics", headers={"authorization": f"Bearer {keys.alice}"}).text
        assert "gateway_state_degraded 1.0" in metrics

        redis.start()  # an empty Redis (no persistence): the replicas must notice and carry on
        wait_until(lambda: not a.gateway.store.degraded and not b.gateway.store.degraded, 10, 0.05, "recovery")
        fresh = new_key()
        asyncio.run_coroutine_threadsafe(a.gateway.store.put_key(ApiKeyConfig(name="fresh", hash=hash_key(fresh))), _loop_of(a)).result(5)
        wait_until(lambda: _chat(b, fresh).status_code == 200, 3.0, 0.05, "a key created after the restart, on the other replica")
        assert _chat(a, limited).status_code == 200


def test_a_redis_that_stops_answering_costs_a_request_at_most_its_deadline(keys):
    # A hung Redis (stopped, its socket open): a batch's replies are bounded by the batch's one
    # deadline (state.timeout x 2), not by a timeout per reply; a limited key falls back and is answered.
    import os
    import signal

    from redisd import RedisServer

    prefix = "t" + secrets.token_hex(4)
    k, limited = _with_key(keys, rate_limit_rpm=1000)
    with RedisServer() as redis, replicas(k, redis.url, prefix, n=1, sim_args=("--ttft", "0", "--tpot", "0"), timeout=0.2) as (gws, _):
        (gw,) = gws
        store = gw.gateway.store
        assert _chat(gw, limited).status_code == 200
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            batch = asyncio.run_coroutine_threadsafe(store._call("test", store._send_raw(b"*1\r\n$4\r\nPING\r\n", 1)), _loop_of(gw))
            with pytest.raises(TimeoutError):
                batch.result(5)
            assert time.monotonic() - t0 < 2.0
            with httpx.Client(timeout=5) as c:
                t0 = time.monotonic()
                r = _chat(gw, limited, c)
                assert r.status_code == 200, r.text
                assert time.monotonic() - t0 < 2.0
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)


def _store_config(url: str):
    from gateway.config import parse_config

    return parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                         "state": {"redis_url": url, "prefix": "t" + secrets.token_hex(4), "timeout": 0.2}})


def test_close_ends_a_subscriber_whose_read_lost_its_cancellation_and_leaves_no_task_pending(redis_server):
    # redis-py can lose a cancellation in a pub/sub read (seen: a gateway's shutdown waiting 60 s on its
    # subscriber, its loop then closed with the tasks pending: "Task was destroyed but it is pending",
    # "RedisStore.close ignored GeneratorExit"). This subscriber loses every one, as such a read does.
    from gateway.state.redis import RedisStore

    class LosesCancellations(RedisStore):
        async def _subscribe(self) -> None:
            ps = self._pubsub = self.r.pubsub()
            await ps.subscribe(self.channel)
            while True:
                try:
                    await ps.connection.read_response(timeout=math.inf, disconnect_on_error=False)  # no timeout: only a message or a failed read ends it
                except asyncio.CancelledError:
                    continue
                except Exception:
                    return

    async def run() -> None:
        store = LosesCancellations(_store_config(redis_server.url))
        await store.start()
        await asyncio.sleep(0.1)  # the subscriber is in its read
        t0 = time.monotonic()
        await asyncio.wait_for(store.close(), 5)
        assert time.monotonic() - t0 < 2.0  # two bounds of state.timeout x 2, not a wait for a message
        assert all(t.done() for t in store._tasks)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(run())


def test_close_cancelled_is_cancelled_not_swallowed(redis_server):
    from gateway.state.redis import RedisStore

    async def run() -> None:
        store = RedisStore(_store_config(redis_server.url))
        await store.start()
        closing = asyncio.create_task(store.close())
        await asyncio.sleep(0)  # close is waiting for the store's tasks
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await store.close()  # a second close finishes the job

    asyncio.run(run())


def test_a_restarted_redis_answers_the_first_admin_call_on_its_stale_pooled_connection():
    # After a Redis restart every pooled connection is dead; the first command on one must not fail
    # the call (seen: `put_key` right after recovery answering "Connection closed by server").
    from redisd import RedisServer

    from gateway.config import ApiKeyConfig
    from gateway.state.redis import RedisStore

    async def run(redis: RedisServer) -> None:
        store = RedisStore(_store_config(redis.url))
        await store.start()
        try:
            await store.put_key(ApiKeyConfig(name="before", hash=hash_key(new_key())))  # the pool holds a connection now
            await asyncio.to_thread(redis.stop)
            await asyncio.to_thread(redis.start)
            after = ApiKeyConfig(name="after", hash=hash_key(new_key()))
            await store.put_key(after)
            assert (await store.get_key(after.hash)) is not None
        finally:
            await store.close()

    with RedisServer() as redis:
        asyncio.run(run(redis))
