"""The /metrics scraper: parsing LMDeploy's exposition, change detection, and polling with the backend's key."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.routing.policies import make_balancer
from gateway.routing.pool import Backend
from gateway.routing.signals import MetricsScraper, Signals, parse_metrics, update_signals

pytestmark = pytest.mark.unit

EXPOSITION = """\
# HELP lmdeploy:num_requests_running Number of requests in model execution batches.
# TYPE lmdeploy:num_requests_running gauge
lmdeploy:num_requests_running{engine="0",model_name="m"} 3.0
lmdeploy:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE lmdeploy:num_requests_waiting gauge
lmdeploy:num_requests_waiting{engine="0",model_name="m"} 1.0
lmdeploy:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
lmdeploy:gpu_cache_usage_perc{engine="1",model_name="m"} 0.7
lmdeploy:generation_tokens_total{engine="0",model_name="m"} 1000.0
lmdeploy:generation_tokens_created{engine="0",model_name="m"} 1.7e9
lmdeploy:prompt_tokens_total{engine="0",model_name="m"} 500.0
lmdeploy:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
process_cpu_seconds_total 12.0
"""

@pytest.mark.parametrize(
    "text, expected",
    [
        (EXPOSITION, {
            "lmdeploy:num_requests_running": 5.0,  # summed over engines (DP ranks)
            "lmdeploy:num_requests_waiting": 1.0,
            "lmdeploy:gpu_cache_usage_perc": 0.6,  # a ratio: averaged
            "lmdeploy:generation_tokens_total": 1000.0,
            "lmdeploy:prompt_tokens_total": 500.0,
        }),
        ("lmdeploy:num_requests_running 7\n", {"lmdeploy:num_requests_running": 7.0}),  # no labels
        ('lmdeploy:num_requests_running{a="}"} 2 1700000000000\n', {"lmdeploy:num_requests_running": 2.0}),  # brace in a label, a timestamp
        ("lmdeploy:num_requests_running{} NaN\nlmdeploy:num_requests_waiting{} +Inf\n", {}),
        ("lmdeploy:num_requests_running{} lots\n", {}),
        ("lmdeploy:num_requests_running{engine=\"0\"\n", {}),  # truncated line
        ("<html>not metrics</html>", {}),
        ("", {}),
    ],
)
def test_parse_metrics_reads_lmdeploy_gauges(text, expected):
    assert parse_metrics(text) == pytest.approx(expected)

def test_signals_change_only_when_the_gauges_refresh_while_the_token_rate_follows_the_counters():
    sig = Signals()
    values = {"lmdeploy:num_requests_running": 4.0, "lmdeploy:generation_tokens_total": 100.0}
    assert update_signals(sig, values, now=10.0) is True  # the first poll
    assert update_signals(sig, values, now=12.0) is False  # LMDeploy refreshes every 10 s
    # counters move on every poll, and that is no refresh of the gauges
    assert update_signals(sig, {**values, "lmdeploy:generation_tokens_total": 600.0}, now=20.0) is False
    assert sig.token_rate == pytest.approx(50.0)
    assert update_signals(sig, {**values, "lmdeploy:num_requests_running": 5.0, "lmdeploy:generation_tokens_total": 600.0}, now=22.0) is True
    assert (sig.changed_at, sig.scraped_at) == (22.0, 22.0)
    assert sig.fresh(40.0) and not sig.fresh(60.0)

class _FakeBackends:
    def __init__(self, bodies: dict[str, tuple[int, str]]):
        self.bodies = bodies
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.host, request.headers.get("authorization")))
        status, body = self.bodies[request.url.host]
        return httpx.Response(status, text=body)

async def test_scraper_polls_healthy_backends_with_their_key_and_feeds_the_balancer():
    fake = _FakeBackends({
        "a.test": (200, EXPOSITION),
        "b.test": (401, '{"error":"unauthorized"}'),
        "c.test": (200, "lmdeploy:num_requests_running 1\n"),
    })
    a = Backend(id="a", url="http://a.test", api_key="sk-a", healthy=True)
    b = Backend(id="b", url="http://b.test", healthy=True)
    c = Backend(id="c", url="http://c.test", healthy=False)
    bal = make_balancer("min_expected_latency")
    calls = []

    def on_sample(backend, sig, changed):
        calls.append((backend.id, changed))
        bal.observe_signals(backend, sig, changed)

    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        scraper = MetricsScraper(lambda: [a, b, c], on_sample, interval=1.0, client=client)
        await scraper.scrape_all()
        await scraper.scrape_all()
    assert sorted(fake.seen) == [("a.test", "Bearer sk-a")] * 2 + [("b.test", None)] * 2  # c is unhealthy: not polled
    assert calls == [("a", True), ("a", False)]
    assert scraper.failures == 2
    assert scraper.signals["a"].running == 5.0 and scraper.signals["a"].kv_usage == pytest.approx(0.6)
    assert bal._model(a).ext == 6.0  # 5 running + 1 waiting, none of them ours
    assert bal._model(a).signals is scraper.signals["a"]
    assert "b" not in scraper.signals

async def test_scraper_drops_the_numbers_of_a_backend_that_left():
    fake = _FakeBackends({"a.test": (200, EXPOSITION), "b.test": (200, EXPOSITION)})
    a = Backend(id="a", url="http://a.test", healthy=True)
    b = Backend(id="b", url="http://b.test", healthy=True)
    members = [a, b]
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        scraper = MetricsScraper(lambda: members, lambda *_: None, interval=1.0, client=client)
        await scraper.scrape_all()
        assert set(scraper.signals) == {"a", "b"}
        members.remove(b)
        await scraper.scrape_all()
    assert set(scraper.signals) == {"a"}


async def test_scraper_task_starts_and_stops():
    fake = _FakeBackends({"a.test": (200, EXPOSITION)})
    a = Backend(id="a", url="http://a.test", healthy=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        scraper = MetricsScraper(lambda: [a], lambda *_: None, interval=0.05, client=client)
        scraper.start()

        for _ in range(100):
            if len(fake.seen) >= 2:
                break
            await asyncio.sleep(0.02)
        await scraper.stop()
    assert len(fake.seen) >= 2

def test_scraper_refuses_a_non_positive_interval():
    with pytest.raises(ValueError):
        MetricsScraper(lambda: [], lambda *_: None, interval=0)
