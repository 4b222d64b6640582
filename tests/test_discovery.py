"""DNS discovery with an injected resolver (no network): addresses in the answer join the pool,
serve traffic, and leave it when they leave the answer; a failed lookup keeps what is there."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.config import ConfigError, DiscoverConfig, HealthConfig, parse_config
from gateway.routing.discovery import DnsDiscovery, NameGone
from gateway.routing.pool import BackendPool
from support import GatewayServer, Sim, free_port, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
NAME = "api-server.ns.svc.cluster.local"


class Answers:
    """A resolver whose answer the test sets; it records every lookup."""

    def __init__(self, *addresses: str):
        self.answer: list[str] | Exception = list(addresses)
        self.lookups: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.lookups.append((name, port))
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


def sim_on(address: str, port: int) -> Sim:
    sim = Sim(MODEL, "--host", address, port=port, ready=False)
    sim.url = f"http://{address}:{port}"
    sim.client.close()
    sim.client = httpx.Client(base_url=sim.url, timeout=10.0)
    sim.wait_ready()
    return sim


def test_discovered_backends_join_serve_and_leave(keys):
    port = free_port()
    resolver = Answers("127.0.0.2", "127.0.0.3")
    with sim_on("127.0.0.2", port) as a, sim_on("127.0.0.3", port) as b:
        cfg = gateway_config(keys, [{"discover": {"dns": NAME, "port": port, "interval": 0.1}}])
        with GatewayServer(cfg, resolver=resolver) as gw:
            pool = gw.gateway.pool
            ids = lambda: sorted(x.id for x in pool)  # noqa: E731
            assert ids() == [f"{NAME}@127.0.0.2", f"{NAME}@127.0.0.3"]
            wait_until(lambda: all(x.healthy for x in pool), 10, 0.02, "both discovered backends healthy")
            assert {x.url for x in pool} == {f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"}
            with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {keys.alice}"}, timeout=20) as c:
                for _ in range(6):
                    assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
            assert a.requests() and b.requests()

            resolver.answer = ["127.0.0.3"]
            wait_until(lambda: ids() == [f"{NAME}@127.0.0.3"], 10, 0.02, "127.0.0.2 to leave the pool")
            a.clear()
            with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {keys.alice}"}, timeout=20) as c:
                for _ in range(3):
                    assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
            assert a.requests() == []

            n = len(resolver.lookups)
            resolver.answer = OSError("SERVFAIL")
            wait_until(lambda: len(resolver.lookups) >= n + 2, 10, 0.02, "two failed lookups")
            assert ids() == [f"{NAME}@127.0.0.3"]  # a failed lookup keeps the backends

            resolver.answer = NameGone(NAME)
            wait_until(lambda: ids() == [], 10, 0.02, "the pool to empty when the name is gone")
            assert all(name == NAME and p == port for name, p in resolver.lookups)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_only_ip_literals_are_used_and_the_answer_is_bounded():
    pool = BackendPool(HealthConfig())
    resolver = Answers("10.0.0.1", "evil.example.com", "10.0.0.1", "::1", "10.0.0.2", "10.0.0.3")
    d = DnsDiscovery(DiscoverConfig(dns=NAME, port=23333, max_backends=3), pool, resolver=resolver)
    # The host name is dropped, the duplicate folded, and the four addresses cut to three.
    assert run(d.resolve()) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    d.config = DiscoverConfig(dns=NAME, port=23333, max_backends=10)
    assert d._url("::1") == "http://[::1]:23333"


def test_a_name_taken_by_a_static_backend_is_left_alone():
    from gateway.routing.pool import Backend

    pool = BackendPool(HealthConfig())
    pool.add(Backend(id=f"{NAME}@10.0.0.1", url="http://10.9.9.9:1"))
    d = DnsDiscovery(DiscoverConfig(dns=NAME, port=23333, models=(MODEL,)), pool, resolver=Answers("10.0.0.1"))

    async def refresh_without_checks():
        pool.check_all = lambda backends=None: asyncio.sleep(0)  # no network in a unit test
        await d.refresh()

    run(refresh_without_checks())
    assert pool.get(f"{NAME}@10.0.0.1").url == "http://10.9.9.9:1" and d.members == set()


@pytest.mark.parametrize("entry,message", [
    ({"discover": {"dns": "bad name!", "port": 1}}, "backends[0].discover.dns: 'bad name!' is not a DNS name"),
    ({"discover": {"dns": NAME}}, "backends[0].discover.port: required field is missing"),
    ({"discover": {"dns": NAME, "port": 1, "interval": 0}}, "backends[0].discover.interval: 0 is out of range; must be >= 0.1"),
    ({"discover": {"dns": NAME, "port": 1}, "url": "http://x"}, "backends[0].url: unknown field; valid fields: discover"),
])
def test_discovery_config_problems_are_named(entry, message):
    with pytest.raises(ConfigError) as exc:
        parse_config({"auth": {"disabled": True}, "backends": [entry]})
    assert exc.value.problems == [message]
