"""The balancer end to end through real sockets: client -> gateway (uvicorn) -> simulated api_servers."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any, Iterator

import httpx
import pytest

from support import GatewayServer, Sim, gateway_config

pytestmark = pytest.mark.e2e

MODEL = "test-model"
TIMING = ("--tpot", "0.01", "--ttft", "0.005", "--metrics-interval", "1")


@contextlib.contextmanager
def fleet(keys, speeds: list[float], policy: str) -> Iterator[tuple[GatewayServer, list[Sim]]]:
    sims: list[Sim] = []
    try:
        for sp in speeds:
            sims.append(Sim(MODEL, *TIMING, "--speed", str(sp), api_key="backend-secret"))
        backends = [{"url": s.url, "api_key": "backend-secret", "name": f"sim-{i}"} for i, s in enumerate(sims)]
        with GatewayServer(gateway_config(keys, backends, balancer={"policy": policy})) as gw:
            for s in sims:
                s.clear()
            yield gw, sims
    finally:
        for s in sims:
            s.stop()


async def _replay(gw: GatewayServer, key: str, bodies: list[dict[str, Any]], gap: float) -> list[int]:
    """Open loop: one request every ``gap`` seconds, each streamed to its end."""
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": f"Bearer {key}"}, timeout=30) as client:

        async def one(i: int, body: dict[str, Any]) -> int:
            await asyncio.sleep(i * gap)
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
                return r.status_code

        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def _body(i: int, system: str | None = None, max_tokens: int = 20) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"question {i}"})
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}


def _served(sim: Sim) -> int:
    return sum(1 for r in sim.requests() if r["path"] == "/v1/chat/completions")


def test_min_expected_latency_sends_most_work_to_the_fast_backend(keys):
    with fleet(keys, [2.0, 0.5], "min_expected_latency") as (gw, (fast, slow)):
        statuses = asyncio.run(_replay(gw, keys.alice, [_body(i) for i in range(60)], gap=0.03))
        assert statuses == [200] * 60
        n_fast, n_slow = _served(fast), _served(slow)
    assert n_fast + n_slow == 60
    assert n_fast >= 3 * n_slow, (n_fast, n_slow)


def test_requests_sharing_a_long_system_prompt_stick_to_one_backend(keys):
    docs = {name: f"[{name}] " + "background material for the assistant. " * 60 for name in ("alpha", "beta", "gamma")}
    order = random.Random(5).choices(sorted(docs), k=40)
    bodies = [_body(i, docs[name], max_tokens=8) for i, name in enumerate(order)]
    with fleet(keys, [1.0, 1.0], "min_expected_latency") as (gw, sims):
        statuses = asyncio.run(_replay(gw, keys.alice, bodies, gap=0.05))
        assert statuses == [200] * 40
        placement = {name: [0, 0] for name in docs}
        for i, s in enumerate(sims):
            for r in s.requests():
                if r["path"] == "/v1/chat/completions":
                    placement[r["body"]["messages"][0]["content"][1:].split("]")[0]][i] += 1
        cached = sum(s.stats()["cached_tokens"] for s in sims)
    for name, counts in placement.items():
        assert max(counts) >= 0.9 * sum(counts), (name, counts)  # least_in_flight: about half
    assert cached > 0


@pytest.mark.parametrize("policy", ["least_in_flight", "round_robin", "random", "least_load"])
def test_every_baseline_policy_serves_through_the_gateway(keys, policy):
    with fleet(keys, [1.0, 1.0], policy) as (gw, sims):
        statuses = asyncio.run(_replay(gw, keys.alice, [_body(i, max_tokens=4) for i in range(10)], gap=0.01))
        assert statuses == [200] * 10
        assert sum(_served(s) for s in sims) == 10
