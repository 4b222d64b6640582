"""Prefill/decode models through the gateway queue end to end: launched prefill and decode simulators,
one batch slot per prefill instance and a slow prefill, so that a second request must wait for the
prefill slot (in the gateway, not the instance); or few slots on the decode instance, so that a burst
waits for decode slots in the gateway, not in the decode instance's batch queue."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import pytest

from gateway.routing import queue as gateway_queue
from support import GatewayServer, gateway_config, wait_until
from test_disagg_e2e import instances, recorded
from test_queue_e2e import Keys, send, shed_count

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture(autouse=True)
def no_hold_wait(monkeypatch):
    """Any predicted wait holds a request back in the gateway (``queue.HOLD_WAIT``, a constant: 0.5 s)."""
    monkeypatch.setattr(gateway_queue, "HOLD_WAIT", 0.0)


def pd_queue_config(keys: Keys, queue: dict[str, Any], prefill: int = 1, prefill_ttft: float = 0.5, prefill_slots: int = 1,
                    decode_slots: int | None = None, decode_tpot: float = 0.002, decode: int = 1) -> dict[str, Any]:
    group = {"model": "sim-model", "model_name": "pd", "engine": "sim", "backend": "pytorch", "health_interval": 0.2, "restart_backoff": 0.05}
    return gateway_config(
        keys,  # type: ignore[arg-type]
        [],
        launch=[
            # One slot (the launcher tells the pool: Backend.slots), and each prefill takes prefill_ttft.
            {**group, "role": "prefill", "instances": prefill, "max_batch_size": prefill_slots, "sim": {"ttft": prefill_ttft, "tpot": 0.002}},
            {**group, "role": "decode", "instances": decode, "sim": {"ttft": 0.005, "tpot": decode_tpot},
             **({"max_batch_size": decode_slots} if decode_slots is not None else {})},
        ],
        models={"pd": {"serving": "distserve"}},
        health={"interval": 0.2, "timeout": 5.0},
        balancer={"queue": queue},
    )


def body(tag: str, tokens: int = 3) -> dict[str, Any]:
    return {"model": "pd", "messages": [{"role": "user", "content": tag}], "max_tokens": tokens, "stream": True}


def waiting(gw: GatewayServer) -> int:
    return gw.gateway.disagg.queue.admission.waiting()


def prefills_seen(b) -> list[str]:
    return [r["body"]["messages"][0]["content"] for r in recorded(b) if r["path"] == CHAT]


def started(gw: GatewayServer, n: int, decode: int = 1) -> GatewayServer:
    wait_until(lambda: len(gw.gateway.pool) == n + decode and all(b.healthy for b in gw.gateway.pool), 30, 0.02, "prefill and decode healthy")
    return gw


async def test_a_flood_with_a_short_max_wait_is_shed_with_503_and_retry_after(log_dir):
    keys = Keys()
    with GatewayServer(pd_queue_config(keys, {"max_wait": {"interactive": 0.3}}, prefill_ttft=1.5), wait_healthy=False) as gw:
        (p,) = instances(started(gw, 1), "prefill")
        before = shed_count(gw, keys.admin, "deadline")
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            first = asyncio.create_task(send(client, keys.ui, body("first")))
            await asyncio.to_thread(wait_until, lambda: p.in_flight == 1, 10, 0.01, "the prefill slot taken")
            flood = await asyncio.wait_for(asyncio.gather(*(send(client, keys.ui, body(f"f{i}")) for i in range(5))), 10)
            assert not first.done()  # every refusal came while the slot was still taken
            assert (await asyncio.wait_for(first, 20))[0] == 200
        for status, seconds, headers, data in flood:
            assert status == 503
            assert headers["retry-after"].isdigit() and int(headers["retry-after"]) >= 1
            err = httpx.Response(503, content=data).json()["error"]
            assert err["type"] == "server_error" and err["code"] == "service_unavailable"
            assert seconds < 1.5  # at its deadline (0.3 s), not after the busy prefill
        assert shed_count(gw, keys.admin, "deadline") - before == 5
        assert prefills_seen(p) == ["first"]  # the shed never reached an instance
        assert waiting(gw) == 0


async def test_an_interactive_key_goes_before_a_waiting_batch_flood(log_dir):
    keys = Keys()
    with GatewayServer(pd_queue_config(keys, {"max_wait": {"interactive": 30, "batch": 60}}, prefill_ttft=0.4), wait_healthy=False) as gw:
        (p,) = instances(started(gw, 1), "prefill")
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            flood = [asyncio.create_task(send(client, keys.bulk, body(f"bulk-{i}"))) for i in range(4)]
            await asyncio.to_thread(wait_until, lambda: waiting(gw) == 3, 10, 0.01, "three batch requests waiting")
            ui = await asyncio.wait_for(send(client, keys.ui, body("ui-0")), 30)
            done = await asyncio.wait_for(asyncio.gather(*flood), 30)
        assert ui[0] == 200 and [d[0] for d in done] == [200] * 4
        order = prefills_seen(p)
        assert order[1] == "ui-0", order  # right after the batch request that held the prefill slot
        assert sorted(order) == sorted(["ui-0", *(f"bulk-{i}" for i in range(4))])
        assert waiting(gw) == 0


async def test_a_prefill_instance_dying_while_requests_wait_leaves_none_hanging(log_dir):
    keys = Keys()
    with GatewayServer(pd_queue_config(keys, {"max_wait": {"interactive": 30}}, prefill=2, prefill_ttft=0.6), wait_healthy=False) as gw:
        doomed, survivor = instances(started(gw, 2), "prefill")
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            tasks = [asyncio.create_task(send(client, keys.ui, body(f"r{i}"))) for i in range(5)]
            await asyncio.to_thread(wait_until, lambda: waiting(gw) == 3, 10, 0.01, "two prefilling, three waiting")
            pid = next(i.pid for i in gw.gateway.launcher.instances if i.id == doomed.id)
            os.kill(pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 45)
        statuses = [r[0] for r in results]
        # The prefill on the dead instance is retried on the other; every one that waited is served.
        assert statuses.count(200) >= 4, statuses
        assert all(s in (200, 502, 503) for s in statuses), statuses
        assert waiting(gw) == 0
        assert sum(b.in_flight for b in gw.gateway.pool) == 0  # every reservation given back


async def test_a_burst_never_overfills_the_decode_batch_and_none_hangs(log_dir):
    # Eight prefill slots but two decode slots, each decode about 0.4 s: a burst of ten must wait for
    # decode slots in the gateway (served two by two, or shed at its max wait), not in the decode engine.
    keys = Keys()
    config = pd_queue_config(keys, {"max_wait": {"interactive": 1.2}}, prefill_ttft=0.05, prefill_slots=8, decode_slots=2, decode_tpot=0.05)
    with GatewayServer(config, wait_healthy=False) as gw:
        (d,) = instances(started(gw, 1), "decode")
        assert d.slots == 2
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            results = await asyncio.wait_for(asyncio.gather(*(send(client, keys.ui, body(f"b{i}", tokens=8)) for i in range(10))), 30)
        statuses = [r[0] for r in results]
        assert statuses.count(200) >= 2 and set(statuses) <= {200, 503}, statuses
        assert statuses.count(503) >= 1, statuses  # 10 x 0.4 s / 2 slots is past the 1.2 s max wait
        for status, _, headers, data in results:
            if status == 503:
                assert headers["retry-after"].isdigit() and int(headers["retry-after"]) >= 1
                assert httpx.Response(503, content=data).json()["error"]["code"] == "service_unavailable"
            else:
                assert b"data: [DONE]" in data
        stats = httpx.get(d.url + "/_sim/stats", timeout=5, trust_env=False).json()
        assert stats["peak_in_flight"] <= 2, stats  # never more than its batch slots
        assert waiting(gw) == 0
        assert sum(b.in_flight for b in gw.gateway.pool) == 0


async def test_a_batch_key_keeps_off_the_prefill_and_decode_instances_the_interactive_requests_use(log_dir):
    keys = Keys()
    head = "x" * 600  # one prompt start: prefix affinity sends every prompt to one prefill instance when they are idle
    with GatewayServer(pd_queue_config(keys, {"max_wait": {"interactive": 30, "batch": 60}}, prefill=2, prefill_ttft=0.02, prefill_slots=8, decode=2),
                       wait_healthy=False) as gw:
        started(gw, 2, decode=2)
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            for i in range(16):  # one at a time: the same prefill instance (affinity), mostly the same decode instance (all idle)
                assert (await send(client, keys.ui, body(f"{head} ui-{i}")))[0] == 200
            for i in range(4):  # without the rule these would go there too (the same start, idle instances)
                assert (await send(client, keys.bulk, body(f"{head} bulk-{i}")))[0] == 200

        def got(b) -> list[str]:
            return [c.split()[1].split("-")[0] for c in prefills_seen(b)]

        by_prefill = {b.id: got(b) for b in instances(gw, "prefill")}
        by_decode = {b.id: got(b) for b in instances(gw, "decode")}
        for seen in (by_prefill, by_decode):
            home = max(seen, key=lambda k: seen[k].count("ui"))
            assert seen[home].count("ui") > 8, seen  # more than half of the interactive requests: kept (pd_keep_share 1)
            assert "bulk" not in seen[home] and sum(v.count("bulk") for v in seen.values()) == 4, seen
        assert waiting(gw) == 0
