"""Replicas share what they know about the backends through Redis: load and ejections."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest

from gateway.config import parse_config
from gateway.routing import queue as gateway_queue
from gateway.state.redis import RedisStore
from support import GatewayServer, Sim, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"


def _pair(keys, sim: Sim, redis_url: str, **sections):
    cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}],
                         state={"redis_url": redis_url, "prefix": "t" + secrets.token_hex(4), "lease_ttl": 3}, **sections)
    return GatewayServer(cfg), GatewayServer(cfg)


def _post(gw: GatewayServer, key: str, **extra) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})


def test_one_replicas_ejection_of_a_failing_backend_is_seen_by_the_other(keys, redis_server):
    with Sim(MODEL, "--ttft", "0", "--tpot", "0", api_key="backend-secret") as sim:
        a, b = _pair(keys, sim, redis_server.url, health={"interval": 0.2, "timeout": 1.0, "failures_to_eject": 3, "ejection_base": 30})
        try:
            sim.control(fail_next={"count": 3, "status": 500})
            for _ in range(3):
                assert _post(a, keys.alice).status_code == 500
            backend_a = a.gateway.pool.get("sim-0")
            assert backend_a.ejected_until > time.monotonic()  # a ejected it itself
            backend_b = b.gateway.pool.get("sim-0")
            started = time.monotonic()
            wait_until(lambda: backend_b.ejected_until > time.monotonic(), 2, 0.02, "the ejection on the other replica")
            assert time.monotonic() - started < 1.0
            assert backend_b.ejected_until - time.monotonic() > 20  # for about as long as a ejected it
            assert _post(b, keys.alice).status_code == 503  # b sends nothing to it meanwhile
        finally:
            a.stop()
            b.stop()


def test_each_replica_learns_the_backends_speed_from_the_others_completions_once(keys, redis_server):
    """Through a real Redis (the speed observations ride the load exchange's placements message): what one
    replica learns from a completion, the other learns too, and neither counts one twice (its own
    observations come back to neither, and what it learnt from the other is not sent on)."""
    with Sim(MODEL, "--ttft", "0", "--tpot", "0.01", api_key="backend-secret") as sim:
        a, b = _pair(keys, sim, redis_server.url)
        try:
            models = [gw.gateway.balancer.models(gw.gateway.pool.get("sim-0")) for gw in (a, b)]
            decay = a.gateway.balancer.DECAY

            def counted(n: int) -> float:
                return sum(decay**i for i in range(n))  # n completions' weight in the decayed sums

            for _ in range(3):
                assert _post(a, keys.alice, max_tokens=8).status_code == 200
            wait_until(lambda: models[1].w > 0, 3, 0.02, "b learning a's completions")
            time.sleep(0.3)  # several exchanges: anything sent twice or back would have landed by now
            assert models[0].w == pytest.approx(counted(3)) and models[1].w == pytest.approx(counted(3))
            assert models[1].sy == pytest.approx(models[0].sy) and models[1].sn == pytest.approx(models[0].sn)
            assert _post(b, keys.alice, max_tokens=8).status_code == 200
            wait_until(lambda: models[0].w > counted(3) + 1e-9, 3, 0.02, "a learning b's completion")
            time.sleep(0.3)
            assert models[0].w == pytest.approx(counted(4)) and models[1].w == pytest.approx(counted(4))
        finally:
            a.stop()
            b.stop()


def test_in_flight_per_backend_is_summed_over_replicas_and_a_dead_replicas_count_expires(keys, redis_server):
    with Sim(MODEL, "--ttft", "2", "--tpot", "0", api_key="backend-secret") as sim:
        a, b = _pair(keys, sim, redis_server.url)
        try:
            done = threading.Event()
            t = threading.Thread(target=lambda: (_post(a, keys.alice), done.set()))
            t.start()
            backend_b = b.gateway.pool.get("sim-0")
            wait_until(lambda: backend_b.remote_in_flight == 1, 3, 0.02, "a's in-flight request counted by b")
            assert backend_b.in_flight == 0
            assert backend_b.remote_kv >= 2  # and the KV it reserves (its prompt + max_tokens 2), as a's balancer counts it
            t.join(10)
            assert done.is_set()
            wait_until(lambda: backend_b.remote_in_flight == 0, 3, 0.02, "the finished request no longer counted")
            assert backend_b.remote_kv == 0
            # A replica that dies mid-request: its count expires with its heartbeat key (lease_ttl 3 s).
            threading.Thread(target=lambda: _post(a, keys.alice), daemon=True).start()
            wait_until(lambda: backend_b.remote_in_flight == 1, 3, 0.02, "counted again")
            a.gateway.store._closing = True  # its heartbeat stops, as if the process were gone
            for task in a.gateway.store._tasks:
                a.gateway.store.loop.call_soon_threadsafe(task.cancel)
            wait_until(lambda: backend_b.remote_in_flight == 0, 6, 0.05, "the dead replica's count expired")
        finally:
            a.stop()
            b.stop()


def test_load_exchange_sums_the_other_replicas_counts_and_a_closing_replica_stops_publishing(redis_server):
    """``exchange_load`` (what the cluster runs every ``state.load_interval``) without the heartbeat's help."""
    import asyncio

    from gateway.config import parse_config
    from gateway.state.redis import RedisStore

    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": redis_server.url, "prefix": "t" + secrets.token_hex(4), "load_interval": 0.05}})
    assert cfg.state.load_interval == 0.05

    async def run() -> None:
        a, b = RedisStore(cfg), RedisStore(cfg)
        seen: dict[str, dict[str, int]] = {}
        try:
            for name, s in (("a", a), ("b", b)):
                await s._heartbeat_once()  # registers the replica (no local_load yet: nothing published)
                s.on_load = lambda totals, name=name: seen.__setitem__(name, dict(totals))
            a.local_load = lambda: {"sim-0": 3}
            b.local_load = lambda: {"sim-0": 2, "sim-1": 1}
            await a.exchange_load()
            await b.exchange_load()
            await a.exchange_load()
            assert seen["a"] == {"sim-0": 2, "sim-1": 1}  # only the other's, never its own
            assert seen["b"] == {"sim-0": 3}
            assert b.remote_in_flight("sim-0") == 3 and b.remote_in_flight("sim-1") == 0
            a.local_load = lambda: {}
            await a.exchange_load()
            await b.exchange_load()
            assert seen["b"] == {}  # a's finished requests are gone at once, not after the lease
            a._closing = True
            a.local_load = lambda: {"sim-0": 9}
            await a.exchange_load()  # a closing replica publishes nothing more
            await b.exchange_load()
            assert seen["b"] == {}
        finally:
            await a.r.aclose()
            await b.r.aclose()

    asyncio.run(run())


def test_what_a_replicas_requests_hold_reaches_the_other_and_a_bad_entry_is_skipped_field_by_field(redis_server):
    """Through a real Redis: what one replica's requests hold on a backend (KV, output left, prefill) lands
    in the other's ``Backend.remote_kv``/``remote_decode``/``remote_prefill``;
    a load entry written by anyone else (Redis content is not trusted) neither breaks the exchange nor
    counts beyond its valid fields, and an entry with too many fields counts not at all."""
    import asyncio

    from gateway.config import parse_config
    from gateway.routing.policies import Outcome, RequestInfo, make_balancer
    from gateway.routing.pool import Backend
    from gateway.state.cluster import KV_FIELD, apply_load, load_entry
    from gateway.state.redis import MAX_LOAD_FIELDS, RedisStore

    prefix = "t" + secrets.token_hex(4)
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": redis_server.url, "prefix": prefix, "load_interval": 0.05}})
    bal = make_balancer("min_expected_latency")
    mine = [Backend(id=f"sim-{i}", url="", models=frozenset({"m"})) for i in range(2)]
    theirs = [Backend(id=f"sim-{i}", url="", models=frozenset({"m"})) for i in range(2)]
    for _ in range(2):
        r = RequestInfo(model="m", prompt_tokens=300, max_tokens=100, stream=True)
        bal.dispatched(mine[0], r)

    async def run() -> None:
        a, b = RedisStore(cfg), RedisStore(cfg)
        try:
            for s in (a, b):
                await s._heartbeat_once()
            # A third "replica" registered by someone with write access, its entry full of junk.
            await b.r.zadd(f"{prefix}:replicas", {"intruder": time.time() + 60})
            await b.r.hset(f"{prefix}:load:intruder", mapping={
                "sim-1": "7", "sim-0": "-5", KV_FIELD + "sim-0": "9" * 14, KV_FIELD + "sim-1": "abc", "x" * 2000: "1"})
            await b.r.zadd(f"{prefix}:replicas", {"flood": time.time() + 60})
            await b.r.hset(f"{prefix}:load:flood", mapping={f"f{i}": 1 for i in range(MAX_LOAD_FIELDS + 1)} | {"sim-0": 50})
            await b.r.zadd(f"{prefix}:replicas", {"wrongtype": time.time() + 60})
            await b.r.set(f"{prefix}:load:wrongtype", "not a hash")  # neither stops the exchange nor takes Redis for down
            a.local_load = lambda: load_entry(mine, bal)
            b.local_load = lambda: load_entry(theirs, None)
            b.on_load = lambda totals: apply_load(theirs, totals)
            await a.exchange_load()
            await b.exchange_load()
            # 2 x (300 + 100) KV, 2 x 100 to decode, 2 x 300 to prefill (no first byte yet)
            assert (theirs[0].remote_in_flight, theirs[0].remote_kv, theirs[0].remote_decode, theirs[0].remote_prefill) == (2, 800, 200, 600)
            assert (theirs[1].remote_in_flight, theirs[1].remote_kv) == (7, 0)  # the intruder's one valid field
            assert not a.degraded and not b.degraded
            for r in list(bal.models(mine[0]).inflight.values()):
                bal.completed(mine[0], r, Outcome(status=200, ok=False))
            await a.exchange_load()
            await b.exchange_load()
            assert (theirs[0].remote_in_flight, theirs[0].remote_kv, theirs[0].remote_decode) == (0, 0, 0)  # done: none counted
        finally:
            await a.r.aclose()
            await b.r.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(("entries", "summed"), [
    ([{b"sim-0": b"2", b"\x00kv\x00sim-0": b"800"}, {b"sim-0": b"1"}], {"sim-0": 3, "\x00kv\x00sim-0": 800}),
    ([{b"sim-0": b"-1"}], {}),  # negative
    ([{b"sim-0": b"1" * 14}], {}),  # longer than any real count: not parsed
    ([{b"sim-0": b"1e3"}, {b"sim-0": b"nan"}], {}),  # not integers
    ([{b"\xff": b"1", b"sim-0": b"4"}], {"sim-0": 4}),  # a field that is not UTF-8 alone is skipped
    ([{b"sim-0": b""}], {}),
    (["not a mapping", {b"sim-0": b"3"}], {"sim-0": 3}),
])
def test_load_entries_from_redis_are_summed_only_where_valid(entries, summed):
    from gateway.state.redis import _sum_loads

    assert _sum_loads(entries) == summed


def test_a_fleet_at_rest_exchanges_its_load_rarely_and_a_request_ends_the_rest_at_once(redis_server):
    """Every load_interval while anything is in flight anywhere; every QUIET_EXCHANGE_EVERY (0.25 s)
    while nothing is: an idle gateway does not keep Redis busy with empty entries."""
    import asyncio

    from gateway.routing.pool import Backend, BackendPool
    from gateway.state.cluster import QUIET_EXCHANGE_EVERY, Cluster

    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": redis_server.url, "prefix": "t" + secrets.token_hex(4), "load_interval": 0.02}})

    async def run() -> None:
        stores, clusters, backends, calls = [], [], [], []
        try:
            for _ in range(2):
                store = RedisStore(cfg)
                await store.start()
                pool = BackendPool(cfg.health)
                backend = Backend(id="sim-0", url="http://sim-0.invalid", models=frozenset({MODEL}), healthy=True)
                pool.add(backend)
                count = [0]
                exchange = store.exchange_load

                async def counted(publish=None, exchange=exchange, count=count):
                    count[0] += 1
                    await exchange(publish)

                store.exchange_load = counted
                cluster = Cluster(store, pool, Backend, publish_backends=False, follow_backends=False)
                cluster.start()
                stores.append(store), clusters.append(cluster), backends.append(backend), calls.append(count)

            async def exchanges_during(seconds: float) -> list[int]:
                before = [c[0] for c in calls]
                await asyncio.sleep(seconds)
                return [c[0] - b for c, b in zip(calls, before)]

            await asyncio.sleep(0.3)  # past the first exchange of each
            assert all(c.quiet() for c in clusters)
            quiet = await exchanges_during(1.0)
            assert all(n <= 1.0 / QUIET_EXCHANGE_EVERY + 2 for n in quiet), quiet  # about 4 each, not 50

            backends[0].in_flight = 1  # a request of replica 0: at its next tick, not 0.25 s later
            busy = await exchanges_during(0.5)
            assert backends[1].remote_in_flight == 1
            assert not clusters[1].quiet()  # the other replica is not at rest either: it sees the request
            assert all(n >= 8 for n in busy), busy  # about 25 each (every 0.02 s)

            backends[0].in_flight = 0  # it ended: the empty entry is written at once, the others see it
            await asyncio.sleep(0.15)
            assert backends[1].remote_in_flight == 0
            assert all(c.quiet() for c in clusters)
        finally:
            for c in clusters:
                await c.stop()
            for s in stores:
                await s.close()

    asyncio.run(run())


def test_load_interval_is_bounded():
    from gateway.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="load_interval"):
        parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                      "state": {"redis_url": "redis://127.0.0.1:6379/0", "load_interval": 0.001}})


def test_two_replicas_never_admit_more_than_a_backends_slots_between_them(keys, redis_server, monkeypatch):
    """One backend with one batch slot, two replicas, held long requests: the replica that sees the slot
    taken through the other holds its requests in its queue (queue.HOLD_WAIT 0), and binds them when the
    other's request finishes. No /metrics polling (scrape_interval 0): the load exchange alone tells it."""
    monkeypatch.setattr(gateway_queue, "HOLD_WAIT", 0.0)
    sim_args = ("--max-batch-size", "1", "--ttft", "0.005", "--tpot", "0.05")
    with Sim(MODEL, *sim_args, api_key="backend-secret") as sim:
        a, b = _pair(keys, sim, redis_server.url, balancer={"slots": 1, "scrape_interval": 0})
        try:
            ba, bb = a.gateway.pool.get("sim-0"), b.gateway.pool.get("sim-0")
            wait_until(lambda: ba.healthy and bb.healthy, 10, 0.02, "healthy on both")
            peak = [0]
            stop = threading.Event()

            def sample() -> None:  # the combined admitted in-flight, as the two replicas hold it
                while not stop.is_set():
                    peak[0] = max(peak[0], ba.in_flight + bb.in_flight)
                    time.sleep(0.002)

            statuses: list[int] = []

            def post(gw: GatewayServer, tokens: int) -> None:
                statuses.append(_post(gw, keys.alice, max_tokens=tokens).status_code)

            sampler = threading.Thread(target=sample)
            sampler.start()
            held = threading.Thread(target=post, args=(a, 40))  # about 2 s on the only slot
            held.start()
            wait_until(lambda: bb.remote_in_flight == 1, 3, 0.01, "a's request seen by b")
            others = [threading.Thread(target=post, args=(b, 4)) for _ in range(3)] + [threading.Thread(target=post, args=(a, 4))]
            for t in others:
                t.start()
            wait_until(lambda: b.gateway.queue.admission.waiting() == 3 and a.gateway.queue.admission.waiting() == 1, 3, 0.01, "waiting on both")
            time.sleep(0.3)  # several load exchanges while a holds the slot
            assert held.is_alive() and bb.in_flight == 0 and sim.stats()["in_flight"] == 1
            for t in [held, *others]:
                t.join(30)
            stop.set()
            sampler.join(5)
            assert statuses == [200] * 5
            assert peak[0] == 1
            assert len([r for r in sim.requests() if r["path"] == "/v1/chat/completions"]) == 5
        finally:
            a.stop()
            b.stop()


def test_followers_learn_launched_backends_with_their_role_and_slots(redis_server):
    """Worker 0 publishes its launched backends; a follower's pool gets their role and batch slots, so its
    queue and PD dispatch treat them as worker 0's do."""
    import asyncio
    import random

    from gateway.config import parse_config
    from gateway.config.balancer import BalancerConfig
    from gateway.routing.policies import RequestInfo, make_balancer
    from gateway.routing.pool import Backend, BackendPool
    from gateway.state.cluster import Cluster
    from gateway.state.redis import RedisStore

    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": redis_server.url, "prefix": "t" + secrets.token_hex(4)}})

    async def run() -> None:
        s0, s1 = RedisStore(cfg), RedisStore(cfg)
        try:
            launched, follower = BackendPool(cfg.health), BackendPool(cfg.health)
            launched.add(Backend(id="pd#0", url="http://127.0.0.1:1001", models=frozenset({"pd"}), origin="launched", role="prefill", slots=8))
            launched.add(Backend(id="m#0", url="http://127.0.0.1:1002", models=frozenset({"m"}), origin="launched"))
            c0 = Cluster(s0, launched, Backend, publish_backends=True, follow_backends=False)
            await c0._publish_directory()
            # An id nobody configured could have (Redis content is not trusted): not learnt.
            await s0.r.hset(c0.directory, "\x00kv\x00m#0", b'{"url": "http://127.0.0.1:1003", "models": ["m"]}')
            await Cluster(s1, follower, Backend, publish_backends=False, follow_backends=True)._follow_directory()
            assert sorted(b.id for b in follower) == ["m#0", "pd#0"]
            p, h = follower.get("pd#0"), follower.get("m#0")
            assert (p.role, p.slots, p.origin) == ("prefill", 8, "launched")
            assert (h.role, h.slots) == ("hybrid", None)
            bal = make_balancer("min_expected_latency", BalancerConfig(), rng=random.Random(0))
            assert bal.predict([p], RequestInfo(model="pd", prompt_tokens=10, max_tokens=10))[0].slots == 8
        finally:
            await s0.r.aclose()
            await s1.r.aclose()

    asyncio.run(run())


async def test_a_replicas_load_entry_outlives_its_last_exchange_by_50_exchanges_not_a_lease(redis_server):
    # A replica that stops exchanging (stopped, stalled) must not keep its last in-flight counts on the
    # others' books for lease_ttl (30 s) after its requests ended: its entry lives 50 exchanges, at least 1 s.
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": redis_server.url, "prefix": "g" + secrets.token_hex(4), "timeout": 1.0,
                                  "lease_ttl": 30, "load_interval": 0.02}})
    store = RedisStore(cfg)
    await store._load_scripts()
    store.local_load = lambda: {"remote-0": 32}
    try:
        await store.exchange_load()
        entry = f"{store.cfg.prefix}:load:{store.replica}"
        assert await store.r.hgetall(entry) == {b"remote-0": b"32"}
        assert 0 < await store.r.pttl(entry) <= 1_000
    finally:
        await store.close()
