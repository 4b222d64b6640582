"""Prefix placements shared across replicas: a stable prefix hash, the placements log, the merge into
the prefix memory, and two gateway replicas on one real redis-server routing a prefix alike."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway.config.balancer import BalancerConfig
from gateway.routing.policies import ExpectedLatencyBalancer, RequestInfo, make_balancer, request_info
from gateway.routing.pool import Backend
from gateway.routing.prefix import BOUNDARIES, MAX_PREFIX_CHARS, Placements, prefix_keys
from support import GatewayServer, Sim, gateway_config, wait_until

pytestmark = pytest.mark.e2e  # the replica tests run gateway servers and a redis-server

MODEL = "test-model"


def _blake(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


# -- the stable hash ------------------------------------------------------------------------------------

@pytest.mark.parametrize("head", ["a" * MAX_PREFIX_CHARS, ("é€ " * 3000)[:MAX_PREFIX_CHARS], "x" * 700, "y" * 255])
def test_prefix_key_i_is_blake2b_of_the_first_boundary_i_chars(head):
    keys = prefix_keys(head)
    want = tuple(_blake(head[:end].encode("utf-8")) for end in BOUNDARIES if end <= len(head))
    assert keys == want
    assert len(keys) == sum(1 for end in BOUNDARIES if end <= len(head))


def test_prefix_keys_are_the_same_in_another_process_with_another_string_hash_seed():
    heads = ["s" * 3000, "système " * 500, "q" * MAX_PREFIX_CHARS]
    code = "import json, sys; from gateway.routing.prefix import prefix_keys; print(json.dumps([prefix_keys(h) for h in json.load(sys.stdin)]))"
    out = {}
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(heads), capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        out[seed] = [tuple(k) for k in json.loads(proc.stdout)]
    assert out["1"] == out["2"] == [prefix_keys(h) for h in heads]


# -- the placements log and the merge -------------------------------------------------------------------

def test_placements_group_by_backend_once_per_chain_and_stay_bounded():
    log = Placements(capacity=3)
    k1, k2 = prefix_keys("a" * 600), prefix_keys("b" * 600)
    log.record("x", k1)
    log.record("y", k2)
    log.record("x", k1)  # the same system prompt again: sent once
    assert log.drain() == {"x": [list(k1)], "y": [list(k2)]}
    assert len(log) == 0 and log.drain() == {}
    for i in range(5):
        log.record("x", (i,))
    assert log.drain() == {"x": [[2], [3], [4]]}  # the oldest dropped when nobody drains
    log.record("x", k1, 500)
    log.record("y", k2, 300)
    log.record("x", k1, 520)  # placed again: once, with its latest size
    assert log.drain_sized() == ({"x": [list(k1)], "y": [list(k2)]}, {"x": [520], "y": [300]})


def _balancer(seed: int) -> ExpectedLatencyBalancer:
    b = make_balancer("min_expected_latency", BalancerConfig(), rng=random.Random(seed))
    assert isinstance(b, ExpectedLatencyBalancer)
    b.SLOW_START = 0.0  # a constant: set on this instance
    return b


def _fleet() -> list[Backend]:
    return [Backend(id=i, url=f"http://{i}.invalid", models=frozenset({"m"}), healthy=True) for i in ("a", "b", "c", "d")]


@pytest.mark.parametrize("seed", range(5))
def test_placements_learnt_from_another_replica_draw_its_prefix_to_the_same_backend(seed):
    keys = prefix_keys("shared document " * 200)
    one, other = _balancer(seed), _balancer(seed + 100)
    log = one.share_placements()
    fleet_one, fleet_other = _fleet(), _fleet()
    r = RequestInfo(model="m", prompt_tokens=900, max_tokens=50, prefix_keys=keys)
    first = one.pick(fleet_one, r)
    one.dispatched(first, r)
    assert other.placements is None  # nothing recorded where nobody asked for it
    sent = log.drain()
    assert sent == {first.id: [list(keys)]}
    by_id = {b.id: b for b in fleet_other}
    for bid, ks in sent.items():
        other.learn_placements(by_id[bid], ks)
    picks = {other.pick(fleet_other, RequestInfo(model="m", prompt_tokens=900, max_tokens=50, prefix_keys=keys)).id for _ in range(10)}
    assert picks == {first.id}
    assert len(other.models(by_id[first.id]).inflight) == 0  # a placement is no load: that comes as remote_in_flight


def test_policies_without_a_prefix_memory_share_nothing():
    for name in ("least_in_flight", "round_robin", "random", "least_load"):
        assert make_balancer(name).shares_prefixes is False
    assert make_balancer("min_expected_latency").shares_prefixes is True


# -- two replicas, one Redis -----------------------------------------------------------------------------

def _body(i: int, question: str) -> dict:
    # One document per i (a few KiB: every prefix key), then a question that differs between the replicas.
    doc = f"document {i}: " + f"paragraph {i} of a long shared context. " * 120
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]}


def _served_by(sims: list[Sim], marker: str) -> list[int]:
    return [j for j, s in enumerate(sims) if any(marker in json.dumps(r) for r in s.requests())]


@contextlib.contextmanager
def _two_replicas(keys, n: int, ttft: str, state: dict):  # type: ignore[no-untyped-def]
    """n sims and two gateway replicas on one Redis (``state``); every process stopped at the end."""
    sims = [Sim(MODEL, "--ttft", ttft, "--tpot", "0", api_key="backend-secret") for _ in range(n)]
    try:
        backends = [{"url": s.url, "api_key": "backend-secret", "name": f"sim-{j}"} for j, s in enumerate(sims)]
        cfg = gateway_config(keys, backends, state={"prefix": "t" + secrets.token_hex(4), **state})
        a, b = GatewayServer(cfg), GatewayServer(cfg)
        try:
            yield sims, a, b
        finally:
            a.stop()
            b.stop()
    finally:
        for s in sims:
            s.stop()


def test_a_prefix_first_routed_by_one_replica_is_routed_to_the_same_backend_by_the_other(keys, redis_server):
    n = 4
    with _two_replicas(keys, n, "0.5", {"redis_url": redis_server.url, "lease_ttl": 3}) as (sims, a, b):
        def post(gw: GatewayServer, body: dict) -> None:
            r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"}, json=body, timeout=30)
            assert r.status_code == 200, r.text

        # Replica a places n documents at once: with each in flight it spreads them over the backends.
        threads = [threading.Thread(target=post, args=(a, _body(i, f"question-a-{i}"))) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        placed = {}
        for i in range(n):
            served = _served_by(sims, f"question-a-{i}")
            assert len(served) == 1
            placed[i] = served[0]
        assert len(set(placed.values())) > 1  # spread: b cannot match them all by picking one backend

        # b learns them through Redis (published with the next load exchange, 50 ms)...
        bal = b.gateway.balancer
        pool = b.gateway.pool
        want = {}  # the keys the two questions on document i share (the document's)
        for i in range(n):
            ka = request_info(MODEL, _body(i, f"question-a-{i}")).prefix_keys
            kb = request_info(MODEL, _body(i, f"question-b-{i}")).prefix_keys
            want[i] = kb[:next((j for j, (x, y) in enumerate(zip(ka, kb)) if x != y), len(kb))]
            assert len(want[i]) >= 5

        def learnt() -> bool:
            return all(bal.models(pool.get(f"sim-{placed[i]}")).prefixes.depth(want[i], bal.clock()) == len(want[i]) for i in range(n))

        wait_until(learnt, 3, 0.02, "b learning a's placements")
        # ...and sends each document's next question where a put the document.
        for i in range(n):
            post(b, _body(i, f"question-b-{i}"))
            assert _served_by(sims, f"question-b-{i}") == [placed[i]], f"document {i}"


def test_with_redis_down_each_replica_keeps_its_own_table_and_sharing_resumes_after(keys):
    from redisd import RedisServer

    with RedisServer() as redis, _two_replicas(keys, 2, "0", {"redis_url": redis.url, "timeout": 0.2}) as (_, a, b):
        def post(gw: GatewayServer, body: dict) -> float:
            t0 = time.monotonic()
            r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"}, json=body, timeout=10)
            assert r.status_code == 200, r.text
            return time.monotonic() - t0

        def held_by(gw: GatewayServer, body: dict) -> set[str]:
            bal, ks = gw.gateway.balancer, request_info(MODEL, body).prefix_keys
            return {bk.id for bk in gw.gateway.pool if bal.models(bk).prefixes.depth(ks, bal.clock()) == len(ks)}

        redis.stop()
        down = _body(0, "while redis is down")
        assert post(a, down) < 2.0  # no Redis call holds a request up
        wait_until(lambda: a.gateway.store.degraded, 5, 0.05, "a notices Redis is down")
        assert len(held_by(a, down)) == 1  # a still remembers its own placement
        assert post(a, _body(0, "again")) < 2.0
        assert held_by(a, _body(0, "again")) == held_by(a, down)
        assert held_by(b, down) == set()  # nothing reached b meanwhile

        redis.start()
        wait_until(lambda: not a.gateway.store.degraded and not b.gateway.store.degraded, 10, 0.05, "recovery")
        up = _body(1, "after the restart")

        def shared_again() -> bool:
            post(a, up)  # placed again (and published again) until b's subscription is back and hears it
            return len(held_by(a, up)) == 1 and held_by(b, up) == held_by(a, up)

        wait_until(shared_again, 10, 0.1, "b learning a's placement again")


def test_many_learnt_chains_on_one_backend_each_keep_their_own_depth():
    # A drained message holds many prompts for one backend: each chain is sized by its own depth
    # (a flat key list longer than BOUNDARIES would overrun the size-aware memory).
    docs = [prefix_keys(f"document {i} " * 900) for i in range(40)]
    assert all(len(k) == len(BOUNDARIES) for k in docs)
    one, other = _balancer(0), _balancer(1)
    log = one.share_placements()
    target = _fleet()[2]
    for keys in docs:
        log.record(target.id, keys)
    sent = log.drain()
    assert list(sent) == [target.id] and len(sent[target.id]) == 40
    other.learn_placements(target, sent[target.id])
    memory = other.models(target).prefixes
    assert all(memory.depth(k, other.clock()) == len(k) for k in docs)


def _receiving_cluster() -> tuple[object, ExpectedLatencyBalancer, Backend]:
    """A Cluster as a replica holds it, its store never connected: only the message handler runs."""
    from gateway.config import parse_config
    from gateway.routing.pool import BackendPool
    from gateway.state.cluster import Cluster
    from gateway.state.redis import RedisStore

    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}],
                        "state": {"redis_url": "redis://127.0.0.1:9/0", "prefix": "t"}})
    pool = BackendPool(cfg.health)
    target = _fleet()[0]
    pool.add(target)
    bal = _balancer(3)
    return Cluster(RedisStore(cfg), pool, Backend, publish_backends=False, follow_backends=False, balancer=bal), bal, target


CHAIN = list(prefix_keys("shared document " * 200))


def test_a_replicas_own_message_echoed_by_the_channel_is_dropped_before_the_parse(monkeypatch):
    # Every replica receives its own placements back from the channel: with N replicas, 1/N of the
    # messages. They are recognised by their first bytes (orjson writes "from" first), never parsed.
    from gateway.routing.prefix import Placements
    from gateway.state import cluster as cluster_mod

    cluster, bal, target = _receiving_cluster()
    parsed: list[bytes] = []
    real = cluster_mod.learn_placements
    monkeypatch.setattr(cluster_mod, "learn_placements", lambda data, *a: (parsed.append(data), real(data, *a)))
    outbox = Placements()
    outbox.record(target.id, tuple(CHAIN), 724)
    own = cluster_mod.placements_message(cluster.store.replica, outbox)
    cluster._on_placements(own)
    assert parsed == []
    outbox.record(target.id, tuple(CHAIN), 724)  # the message drained it
    other = cluster_mod.placements_message(cluster.store.replica + "0", outbox)  # another replica whose id starts as ours
    cluster._on_placements(other)
    assert parsed == [other]
    assert bal.models(target).prefixes.depth(tuple(CHAIN), bal.clock()) == len(CHAIN)


def test_learnt_prompts_with_their_size_evict_from_the_memory_as_the_engine_does():
    # The KV cache has room for about 2500 tokens: another replica's document of 2048 tokens (in a
    # 2500-token prompt) pushes an older one of the same size out. Without sizes (an older replica),
    # only the keys' segments count and both seem cached.
    old_doc, new_doc = prefix_keys("o" * MAX_PREFIX_CHARS), prefix_keys("n" * MAX_PREFIX_CHARS)
    kept = {}
    for sized in (True, False):
        bal = _balancer(5)
        (a,) = _fleet()[:1]
        bal.models(a).kv_capacity = 2500.0 / bal.PREFIX_ROOM  # the memory keeps PREFIX_ROOM x the free KV: 2500
        tokens = [2500] if sized else None
        bal.learn_placements(a, [list(old_doc)], tokens)
        bal.learn_placements(a, [list(new_doc)], tokens)
        memory = bal.models(a).prefixes
        kept[sized] = (memory.depth(old_doc, bal.clock()), memory.depth(new_doc, bal.clock()))
    assert kept[True][1] == len(new_doc) and kept[True][0] < 3  # the newest whole, the oldest (almost) gone
    assert kept[False] == (len(old_doc), len(new_doc))


@pytest.mark.parametrize(("tokens", "sized"), [
    ({"a": [2500]}, True),
    ({"a": [2500, 10]}, False),  # not one count per chain
    ({"a": ["2500"]}, False),  # not an integer
    ({"a": [True]}, False),
    ({"a": [-1]}, False),
    ({"a": [10**8]}, False),  # larger than any prompt
    ([2500], False),
    (None, False),  # an older replica sends no sizes: the chains still count
])
def test_the_sizes_beside_the_chains_are_validated_and_a_bad_one_costs_only_the_size(tokens, sized):
    cluster, bal, target = _receiving_cluster()
    bal.models(target).kv_capacity = 500.0 / bal.PREFIX_ROOM  # a room (PREFIX_ROOM x the free KV) smaller than the chain (8 keys, 724 tokens)
    message = {"from": "other", "p": {"a": [CHAIN]}} | ({"t": tokens} if tokens is not None else {})
    cluster._on_placements(json.dumps(message).encode())
    depth = bal.models(target).prefixes.depth(tuple(CHAIN), bal.clock())
    assert depth > 0  # learnt either way
    assert (depth < len(CHAIN)) is sized  # a sized prompt over the room is cut as the engine's LRU does


@pytest.mark.parametrize(("message", "learnt"), [
    ({"from": "other", "p": {"a": [CHAIN]}}, True),  # well formed
    ({"from": "other", "p": {"zz": [CHAIN]}}, False),  # a backend this replica does not have
    ({"from": "other", "p": {"a": [CHAIN + [1] * 16]}}, False),  # longer than any prompt's chain
    ({"from": "other", "p": {"a": [[*CHAIN[:-1], "x"]]}}, False),  # not all integers
    ({"from": "other", "p": {"a": CHAIN}}, False),  # a flat key list, not chains
    ({"from": "other", "p": [CHAIN]}, False),
    ({"p": {"a": [CHAIN]}, "from": "other", "pad": "x" * (1 << 20)}, False),  # over the byte cap: not even parsed
])
def test_a_placements_message_is_bounded_and_validated_before_anything_is_learnt(message, learnt):
    cluster, bal, target = _receiving_cluster()
    cluster._on_placements(json.dumps(message).encode())
    assert (bal.models(target).prefixes.depth(tuple(CHAIN), bal.clock()) == len(CHAIN)) is learnt
    cluster._on_placements(b"{not json")  # ignored, never raised
    cluster._on_placements(json.dumps({"from": cluster.store.replica, "p": {"a": [CHAIN]}}).encode())  # its own echo
    assert (bal.models(target).prefixes.depth(tuple(CHAIN), bal.clock()) == len(CHAIN)) is learnt


@pytest.mark.parametrize(("speeds", "learnt"), [
    ({"a": [0.02, 3.5, 0.03, 1]}, 2),  # two observations (y, n̄): a whole n̄ arrives as an integer
    ({"a": [0.02, 3.5, 0.03]}, 0),  # not whole pairs
    ({"a": [0.02, 0.5]}, 0),  # a mean batch under 1
    ({"a": [-0.02, 3.0, 0.0, 3.0]}, 0),  # not a positive speed
    ({"a": [1e6, 3.0, 0.02, 1e9]}, 0),  # past any real seconds per token or batch
    ({"a": ["0.02", 3.0, True, 3.0, None, 2.0]}, 0),  # not numbers
    ({"a": [0.02, 3.0] * 1500}, 1024),  # at most 1024 a backend in one message: the newest
    ({"zz": [0.02, 3.0]}, 0),  # a backend this replica does not have
    ({"a": {"y": 0.02}}, 0),
    ([0.02, 3.0], 0),
])
def test_speed_observations_in_a_message_are_validated_and_bounded(speeds, learnt):
    cluster, bal, target = _receiving_cluster()
    cluster._on_placements(json.dumps({"from": "other", "p": {}, "o": speeds}).encode())
    m = bal.models.get(target)
    assert (m.w if m is not None else 0.0) == pytest.approx(sum(bal.DECAY ** i for i in range(learnt)))
    before = m.w if m is not None else 0.0
    cluster._on_placements(json.dumps({"from": cluster.store.replica, "p": {}, "o": {"a": [0.02, 3.0]}}).encode())
    assert (bal.models.get(target).w if bal.models.get(target) is not None else 0.0) == before  # its own echo: not twice


def test_speed_observations_ride_the_placements_log_and_leave_it_drained():
    log = Placements(capacity=4)
    assert not len(log)
    for i in range(6):
        log.observe("a" if i % 2 else "b", 0.01 * (i + 1), 1.0 + i)
    assert len(log) == 4  # bounded: the oldest dropped while nobody drains it
    assert log.drain_speeds() == {"b": [0.03, 3.0, 0.05, 5.0], "a": [0.04, 4.0, 0.06, 6.0]}
    assert not len(log) and log.drain_speeds() == {}
