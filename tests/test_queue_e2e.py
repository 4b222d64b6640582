"""The gateway queue end to end: client -> gateway (uvicorn) -> simulated api_servers with one batch
slot each, so that a second request on a backend must wait (in the gateway, not the backend)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Iterator

import httpx
import pytest

from unittest import mock

from gateway.routing import queue as gateway_queue
from gateway.state.keys import hash_key, new_key
from support import GatewayServer, Sim, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
SIM_ARGS = ("--max-batch-size", "1", "--tpot", "0.05", "--ttft", "0.005", "--metrics-interval", "1")


class Keys:
    def __init__(self) -> None:
        self.ui = new_key()
        self.bulk = new_key()
        self.admin = new_key()
        self.entries = [
            {"name": "ui", "hash": hash_key(self.ui), "priority": "interactive"},
            {"name": "bulk", "hash": hash_key(self.bulk), "priority": "batch"},
            {"name": "ops", "hash": hash_key(self.admin), "admin": True},
        ]


def hold_wait(seconds: float) -> Any:
    """``queue.HOLD_WAIT`` (a constant, 0.5 s; was balancer.queue.hold_wait) for the gateways started within."""
    return mock.patch.object(gateway_queue, "HOLD_WAIT", seconds)


@contextlib.contextmanager
def fleet(n: int, queue: dict[str, Any]) -> Iterator[tuple[GatewayServer, list[Sim], Keys]]:
    keys = Keys()
    sims: list[Sim] = []
    try:
        for _ in range(n):
            sims.append(Sim(MODEL, *SIM_ARGS, api_key="backend-secret"))
        config = {
            "auth": {"keys": keys.entries},
            "backends": [{"url": s.url, "api_key": "backend-secret", "name": f"sim-{i}"} for i, s in enumerate(sims)],
            "health": {"interval": 0.2, "timeout": 1.0},
            # One slot per backend, as the sims are started; any wait for it holds a request back.
            "balancer": {"policy": "min_expected_latency", "slots": 1, "queue": queue},
        }
        with hold_wait(0.0), GatewayServer(config) as gw:
            wait_until(lambda: all(b.healthy for b in gw.gateway.pool), 10, 0.02, "every backend healthy")
            yield gw, sims, keys
    finally:
        for s in sims:
            s.stop()


def body(tag: str, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": tag}], "max_tokens": tokens, "stream": True}


async def send(client: httpx.AsyncClient, key: str, payload: dict[str, Any]) -> tuple[int, float, dict[str, str], bytes]:
    """(status, seconds, headers, body) of one streamed request, read to its end."""
    t0 = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {key}"}) as r:
        data = b"".join([chunk async for chunk in r.aiter_bytes()])
        return r.status_code, time.monotonic() - t0, dict(r.headers), data


def shed_count(gw: GatewayServer, key: str, reason: str) -> float:
    """Interactive refusals for ``reason``, over every model (the counter is labelled by model too)."""
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {key}"}).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_queue_shed_total{") and f'reason="{reason}"' in line and 'priority="interactive"' in line
    )


def waiting(gw: GatewayServer) -> int:
    return gw.gateway.queue.admission.waiting()


async def test_requests_that_cannot_start_in_time_are_refused_with_503_and_retry_after():
    with fleet(1, {"max_wait": {"interactive": 0.5}}) as (gw, (sim,), keys):
        before = shed_count(gw, keys.admin, "deadline")
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            busy = asyncio.create_task(send(client, keys.ui, body("long", 60)))  # the only slot, for about 3 s
            await asyncio.to_thread(wait_until, lambda: sim.stats()["in_flight"] == 1, 10, 0.02, "the slot taken")
            results = await asyncio.wait_for(asyncio.gather(*(send(client, keys.ui, body(f"w{i}", 5)) for i in range(3))), 10)
            assert not busy.done()  # every refusal came while the slot was still taken
            status, _, _, _ = await asyncio.wait_for(busy, 20)
        assert status == 200
        for status, seconds, headers, data in results:
            assert status == 503
            assert headers["retry-after"].isdigit() and int(headers["retry-after"]) >= 1
            # The same prediction in ms (the openai SDK reads it first): Retry-After is it rounded up.
            ms = int(headers["retry-after-ms"])
            assert 1 <= ms <= 60_000 and int(headers["retry-after"]) == max(1, -(-ms // 1000))
            err = httpx.Response(503, content=data).json()["error"]
            assert err["type"] == "server_error" and err["code"] == "service_unavailable" and "busy" in err["message"]
            assert seconds < 0.5 + 2.0  # at the deadline, not after the busy request
        assert shed_count(gw, keys.admin, "deadline") - before == 3
        assert len([r for r in sim.requests() if r["path"] == "/v1/chat/completions"]) == 1  # the refused never reached it
        assert waiting(gw) == 0


async def test_interactive_requests_go_before_a_waiting_batch_flood():
    with fleet(1, {"max_wait": {"interactive": 30, "batch": 60}}) as (gw, (sim,), keys):
        sim.clear()
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            flood = [asyncio.create_task(send(client, keys.bulk, body(f"bulk-{i}", 6))) for i in range(4)]
            await asyncio.to_thread(wait_until, lambda: waiting(gw) == 3, 10, 0.02, "three batch requests waiting")
            ui = await asyncio.wait_for(send(client, keys.ui, body("ui-0", 2)), 30)
            done = await asyncio.wait_for(asyncio.gather(*flood), 30)
        assert ui[0] == 200 and [d[0] for d in done] == [200] * 4
        order = [r["body"]["messages"][0]["content"] for r in sim.requests() if r["path"] == "/v1/chat/completions"]
        assert order[1] == "ui-0", order  # right after the batch request that held the slot
        assert sorted(order) == sorted(["ui-0", *(f"bulk-{i}" for i in range(4))])


async def test_a_backend_dying_while_requests_wait_leaves_none_hanging():
    with fleet(2, {"max_wait": {"interactive": 30}}) as (gw, (doomed, survivor), keys):
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            tasks = [asyncio.create_task(send(client, keys.ui, body(f"r{i}", 20))) for i in range(5)]
            await asyncio.to_thread(wait_until, lambda: waiting(gw) == 3, 10, 0.02, "two running, three waiting")
            await asyncio.to_thread(doomed.kill)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 45)
        statuses = [r[0] for r in results]
        # The one running on the dead backend may end broken; every one that waited is served.
        assert statuses.count(200) >= 4, statuses
        assert all(s in (200, 502) for s in statuses)
        assert waiting(gw) == 0
        assert len([r for r in survivor.requests() if r["path"] == "/v1/chat/completions"]) >= 4


@pytest.mark.parametrize("policy", ["round_robin"])
async def test_policies_without_predictions_run_without_the_queue(policy):
    keys = Keys()
    with Sim(MODEL, *SIM_ARGS, api_key="backend-secret") as sim:
        config = {
            "auth": {"keys": keys.entries},
            "backends": [{"url": sim.url, "api_key": "backend-secret"}],
            "balancer": {"policy": policy},
        }
        with GatewayServer(config) as gw:
            assert gw.gateway.queue is None and gw.gateway.scraper is None
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                assert (await send(client, keys.ui, body("x", 2)))[0] == 200


async def test_a_burst_after_a_quiet_spell_on_a_cold_engine_is_served_not_refused():
    """What a real api_server on an H200 showed (deploy/gpu_smoke.py): a few requests one at a time,
    a pause, then 96 streams 32 at a time on a backend with 8 batch slots whose first batch is slow
    (kernels not yet warm). Straight to the backend every stream is served within seconds; the queue
    refused most of them with 503 by a rate it had measured in the quiet spell and from one batch
    ending together. It must serve them all."""
    keys = Keys()
    cold = ("--max-batch-size", "8", "--tpot", "0.02", "--ttft", "0.005", "--metrics-interval", "1",
            "--cold-steps", "40", "--cold-factor", "4")  # the first burst batch: ~3 s, the next ones ~0.75 s
    with Sim(MODEL, *cold, api_key="backend-secret") as sim:
        config = {
            "auth": {"keys": keys.entries},
            "backends": [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}],
            "health": {"interval": 0.2, "timeout": 1.0},
            # 8 slots, as for a launched --max-batch-size 8; a request waits in the gateway rather than
            # for a slot in the engine (the GPU's batches were longer than HOLD_WAIT, these are not)
            "balancer": {"policy": "min_expected_latency", "slots": 8},
        }
        with hold_wait(0.1), GatewayServer(config) as gw:
            wait_until(lambda: all(b.healthy for b in gw.gateway.pool), 10, 0.02, "the backend healthy")
            before = shed_count(gw, keys.admin, "predicted")
            async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=httpx.Limits(max_connections=40)) as client:
                for i in range(4):  # the quiet spell: responses end as fast as these come
                    assert (await send(client, keys.ui, body(f"quiet-{i}", 1)))[0] == 200
                    await asyncio.sleep(0.5)
                await asyncio.sleep(1.5)
                gate = asyncio.Semaphore(32)

                async def one(i: int) -> int:
                    async with gate:
                        return (await send(client, keys.ui, body(f"burst-{i}", 32)))[0]

                statuses = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(96))), 60)
            assert statuses == [200] * 96, f"{statuses.count(503)} of 96 refused"
            assert shed_count(gw, keys.admin, "predicted") == before
            assert sim.stats()["peak_in_flight"] < 32  # some of every 32 waited in the gateway, not in the engine
            assert waiting(gw) == 0


async def test_a_burst_after_direct_clients_left_is_not_held_back_by_their_old_gauges():
    """The H200's warm rounds (deploy/gpu_smoke.py): 96 streams straight to the api_server, then 96
    through the gateway. LMDeploy refreshes its load gauges every 10 s, so they still showed the
    direct load after it ended: the backend looked full of others' work, the queue let one request at
    a time through for 8 s and shed 53 of 96. A request that starts at once shows the gauges out of
    date (gateway/routing/policies/expected_latency.py, ``_bound_external``)."""
    keys = Keys()
    args = ("--max-batch-size", "8", "--tpot", "0.02", "--ttft", "0.005", "--metrics-interval", "4")
    with Sim(MODEL, *args, api_key="backend-secret") as sim:
        config = {
            "auth": {"keys": keys.entries},
            "backends": [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}],
            "health": {"interval": 0.2, "timeout": 1.0},
            "balancer": {"policy": "min_expected_latency", "slots": 8, "scrape_interval": 0.1,
                         "queue": {"max_wait": {"interactive": 2}}},
        }
        with hold_wait(0.1), GatewayServer(config) as gw:
            wait_until(lambda: all(b.healthy for b in gw.gateway.pool), 10, 0.02, "the backend healthy")
            (backend,) = list(gw.gateway.pool)
            model = gw.gateway.balancer._model(backend)
            headers = {"authorization": "Bearer backend-secret"}
            async with httpx.AsyncClient(base_url=sim.url, timeout=30, headers=headers) as direct:
                async def long_direct(i: int) -> None:
                    with contextlib.suppress(httpx.HTTPError):
                        async with direct.stream("POST", "/v1/chat/completions", json=body(f"direct-{i}", 2000)) as r:
                            async for _ in r.aiter_bytes():
                                pass

                clients = [asyncio.create_task(long_direct(i)) for i in range(24)]
                try:  # until a gauge refresh has shown them (8 running, 16 waiting) and the gateway read it
                    await asyncio.to_thread(wait_until, lambda: model.ext >= 16, 10, 0.02, "the direct load in the gauges")
                finally:
                    for t in clients:
                        t.cancel()
                    await asyncio.gather(*clients, return_exceptions=True)
            # The direct clients are gone (the simulator aborts their requests); the gauges show them
            # for up to 4 s more.
            wait_until(lambda: sim.stats()["in_flight"] == 0, 5, 0.02, "the direct requests aborted")
            assert model.ext >= 16 and model.signals is not None and model.signals.running == 8
            before = shed_count(gw, keys.admin, "predicted"), shed_count(gw, keys.admin, "deadline")
            peak = 0

            async def watch() -> None:  # the most of ours on the backend at once during the burst
                nonlocal peak
                while True:
                    peak = max(peak, len(model.inflight))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            async with httpx.AsyncClient(base_url=gw.url, timeout=30, limits=httpx.Limits(max_connections=40)) as client:
                statuses = await asyncio.wait_for(
                    asyncio.gather(*(send(client, keys.ui, body(f"burst-{i}", 16)) for i in range(32))), 30)
            watcher.cancel()
            codes = [s[0] for s in statuses]
            assert codes == [200] * 32, f"{codes.count(503)} of 32 refused"
            assert (shed_count(gw, keys.admin, "predicted"), shed_count(gw, keys.admin, "deadline")) == before
            assert peak >= 8  # the backend's slots were used, not one at a time
            assert waiting(gw) == 0
