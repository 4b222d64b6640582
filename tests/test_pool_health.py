"""The pool, sole owner of backend health: its /health parser, its checker (through httpx, mocked
with respx) and the methods others use instead of writing fields."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import respx

from gateway.config import HealthConfig
from gateway.routing.pool import MAX_HEALTH_BODY, Backend, BackendPool, parse_health

pytestmark = pytest.mark.unit

URL = "http://10.9.9.9:23333"


@pytest.mark.parametrize(
    "code, body, status",
    [
        (200, b'{"status": "healthy"}', "healthy"),
        (200, b"", "healthy"),  # lmdeploy's older /health: 200, empty body
        (200, b'{"status": "sleeping"}', "sleeping"),
        (503, b'{"status": "healthy"}', "http 503"),  # a body cannot overrule the status code
        (500, b"", "http 500"),
        (200, b"<html>ok</html>", "http 200"),
        (200, b'{"status": 1}', "http 200"),
        (200, b'{"status": "\\u001b[2Jevil\\nline"}', "2Jevilline"),  # bounded and plain: it reaches logs
        (200, b'{"status": "' + b"x" * 500 + b'"}', "x" * 32),
    ],
)
def test_one_health_parser(code, body, status):
    assert parse_health(code, body) == status


def pool_with(*backends: Backend, **health) -> tuple[BackendPool, httpx.AsyncClient]:
    client = httpx.AsyncClient()
    pool = BackendPool(HealthConfig(**health), client)
    for b in backends:
        pool.add(b)
    return pool, client


def backend(**kw) -> Backend:
    return Backend(id=kw.pop("id", "b0"), url=kw.pop("url", URL), models=frozenset({"m"}), static_models=True, **kw)


@respx.mock
async def test_a_healthy_probe_puts_a_backend_in_rotation_and_a_bad_one_takes_it_out():
    route = respx.get(f"{URL}/health")
    b = backend(api_key="k")
    pool, client = pool_with(b)
    route.respond(200, json={"status": "healthy"})
    assert await pool.check(b) and b.healthy and pool.eligible("m") == [b]
    assert route.calls.last.request.headers["authorization"] == "Bearer k"
    route.respond(200, json={"status": "sleeping"})
    assert not await pool.check(b) and b.health_status == "sleeping" and pool.eligible("m") == []
    route.side_effect = httpx.ConnectError("refused")
    assert not await pool.check(b) and b.health_status == "unreachable"
    await client.aclose()


@respx.mock
async def test_an_oversized_health_body_is_not_read_whole_and_is_not_healthy():
    respx.get(f"{URL}/health").respond(200, content=b'{"status": "healthy"' + b" " * (4 * MAX_HEALTH_BODY) + b"}")
    b = backend()
    pool, client = pool_with(b)
    assert not await pool.check(b) and b.health_status == "http oversized"
    await client.aclose()


@respx.mock
async def test_models_are_read_from_v1_models_when_not_configured():
    respx.get(f"{URL}/health").respond(200, json={"status": "healthy"})
    models = respx.get(f"{URL}/v1/models").respond(200, json={"data": [{"id": "a"}, {"id": "b"}, {"x": 1}]})
    b = Backend(id="b0", url=URL)
    pool, client = pool_with(b)
    assert await pool.check(b) and b.models == frozenset({"a", "b"}) and models.call_count == 1
    models.respond(500)
    b.models = frozenset()
    assert not await pool.check(b) and b.health_status == "models_unavailable"
    await client.aclose()


@respx.mock
async def test_a_probe_that_returns_after_a_readmit_is_ignored():
    gate = asyncio.Event()

    async def slow(request):
        await gate.wait()
        return httpx.Response(200, json={"status": "healthy"})

    respx.get(f"{URL}/health").mock(side_effect=slow)
    b = backend()
    pool, client = pool_with(b)
    probe = asyncio.ensure_future(pool.check(b))
    await asyncio.sleep(0)  # the probe is out
    pool.readmit("b0", "http://10.9.9.9:24444")  # a new process on another port
    gate.set()
    assert await probe is False and not b.healthy and b.health_status == "unknown"
    await client.aclose()


async def test_readmit_forgets_failures_and_ejection_and_waits_for_a_passing_check():
    b = backend(healthy=True, health_status="healthy")
    pool = BackendPool(HealthConfig(failures_to_eject=2))
    pool.add(b)
    pool.report_failure(b)
    pool.report_failure(b)
    assert b.ejected_until > 0 and pool.eligible("m") == []
    pool.readmit("b0", "http://127.0.0.1:5")
    assert (b.url, b.ejected_until, b.ejections, b.consecutive_failures, b.healthy) == ("http://127.0.0.1:5", 0.0, 0, 0, False)
    assert pool.readmit("nobody") is None


async def test_mark_down_takes_a_backend_out_at_once():
    b = backend(healthy=True, health_status="healthy")
    pool = BackendPool(HealthConfig())
    pool.add(b)
    assert pool.healthy_models() == frozenset({"m"})
    pool.mark_down("b0", "exited")
    assert not b.healthy and b.health_status == "exited" and pool.eligible("m") == [] and pool.healthy_models() == frozenset()


async def test_remove_tells_the_listeners_and_a_failing_listener_does_not_stop_it():
    b = backend(healthy=True)
    pool = BackendPool(HealthConfig())
    pool.add(b)
    seen: list[str] = []

    def broken(_: Backend) -> None:
        raise RuntimeError("listener bug")

    pool.on_removed += [broken, lambda gone: seen.append(gone.id)]
    assert pool.remove("b0") is b and seen == ["b0"] and len(pool) == 0 and not b.healthy
    assert pool.remove("b0") is None and seen == ["b0"]


async def test_drain_stops_new_picks_and_waits_for_in_flight_requests():
    b = backend(healthy=True, health_status="healthy", in_flight=2)
    pool = BackendPool(HealthConfig())
    pool.add(b)
    draining = asyncio.ensure_future(pool.drain("b0", timeout=5))
    await asyncio.sleep(0)
    assert pool.eligible("m") == [] and not draining.done()
    b.in_flight = 0  # the two requests completed
    assert await draining is True
    assert await pool.drain("b0", timeout=0) is True
    b.in_flight = 1
    assert await pool.drain("b0", timeout=0.01) is False
    pool.undrain("b0")
    assert pool.eligible("m") == [b]


@respx.mock
async def test_the_checker_probes_each_backend_at_its_own_interval():
    fast = respx.get(f"{URL}/health").respond(200, json={"status": "healthy"})
    slow = respx.get("http://10.9.9.8:1/health").respond(200, json={"status": "healthy"})
    a = backend(id="fast", check_interval=0.05)
    b = backend(id="slow", url="http://10.9.9.8:1", check_interval=60.0)
    pool, client = pool_with(a, b, interval=30.0)
    pool.start()
    try:
        deadline = asyncio.get_running_loop().time() + 5
        while fast.call_count < 6 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert fast.call_count >= 6
        # The slow one: its first check (it was not healthy yet), then one at health.interval (30 s) at the earliest.
        assert slow.call_count == 1 and a.healthy and b.healthy
    finally:
        await pool.stop()
        await client.aclose()


@respx.mock
async def test_model_lists_are_bounded_in_bytes_count_and_id_length():
    respx.get(f"{URL}/health").respond(200, json={"status": "healthy"})
    models = respx.get(f"{URL}/v1/models")
    b = Backend(id="b0", url=URL)
    pool, client = pool_with(b)
    models.respond(200, json={"data": [{"id": "ok"}, {"id": "x" * 300}, {"id": "bad\nline"}, {"id": 5}]})
    assert await pool.check(b) and b.models == frozenset({"ok"})
    b.models = frozenset()
    models.respond(200, json={"data": [{"id": f"m{i}"} for i in range(5000)]})
    assert await pool.check(b) and len(b.models) == 1024
    b.models = frozenset()
    models.respond(200, content=b'{"data": [' + b'{"id": "m"},' * 200_000 + b'{"id": "m"}]}')
    assert not await pool.check(b) and b.health_status == "models_unavailable"
    await client.aclose()


async def test_ejections_are_told_to_listeners_and_can_be_applied_from_elsewhere():
    a, b = backend(id="a", healthy=True), backend(id="b", healthy=True)
    pool = BackendPool(HealthConfig(failures_to_eject=2, ejection_base=5.0))
    pool.add(a)
    pool.add(b)
    told: list[tuple[str, int]] = []
    pool.on_change(lambda changed: told.append((changed.id, changed.ejections)))
    pool.report_failure(a)
    assert told == [] and pool.eligible("m") == [a, b]
    pool.report_failure(a)
    assert told == [("a", 1)] and 4.5 <= a.ejected_until - time.monotonic() <= 5.5 and pool.eligible("m") == [b]
    pool.eject("b", 3.0)  # another replica ejected it: a change, but not one of this pool's ejections
    assert pool.eligible("m") == [] and told[-1] == ("b", 0)
    pool.eject("b", 1e9)  # a replica's word is bounded by our own longest backoff
    assert b.ejected_until - time.monotonic() <= 5.0 * 64 * 1.1
    pool.eject("nobody", 3.0)
