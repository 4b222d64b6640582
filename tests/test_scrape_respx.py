"""Scraping a backend's /metrics through the control-plane httpx client, mocked with respx.

What a backend sends back is untrusted: errors, timeouts, redirects and bodies that are not
LMDeploy's exposition must leave the balancer's last numbers alone and never raise.
(The pool's /health and /v1/models checks have their respx tests in tests/test_pool_health.py.)
"""

from __future__ import annotations

import httpx
import pytest
import respx

from gateway.config import TimeoutsConfig
from gateway.routing.pool import Backend
from gateway.routing.signals import MetricsScraper
from gateway.upstream import make_client

pytestmark = pytest.mark.unit

URL = "http://10.1.1.1:23333"
GOOD = 'lmdeploy:num_requests_running{engine="0"} 3\nlmdeploy:num_requests_waiting{engine="0"} 2\nlmdeploy:gpu_cache_usage_perc 0.25\n'


class Samples:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float, float, bool]] = []

    def __call__(self, backend: Backend, sig, changed: bool) -> None:
        self.seen.append((backend.id, sig.running, sig.waiting, changed))


@pytest.fixture
async def client():
    # The gateway's own control-plane client, on httpx's transport so that respx sees its requests.
    c = make_client(TimeoutsConfig(connect=1.0), transport=httpx.AsyncHTTPTransport())
    yield c
    await c.aclose()


def scraper_for(client: httpx.AsyncClient, *backends: Backend) -> tuple[MetricsScraper, Samples]:
    samples = Samples()
    return MetricsScraper(lambda: list(backends), samples, interval=1.0, timeout=0.5, client=client), samples


@respx.mock
async def test_a_good_exposition_feeds_the_balancer_with_the_backend_key(client):
    route = respx.get(f"{URL}/metrics").respond(200, text=GOOD)
    b = Backend(id="b", url=URL, api_key="sk-backend", healthy=True)
    scraper, samples = scraper_for(client, b)
    assert await scraper.scrape(b) is True
    assert samples.seen == [("b", 3.0, 2.0, True)]
    request = route.calls.last.request
    assert request.headers["authorization"] == "Bearer sk-backend"
    assert request.headers["accept-encoding"] == "identity"  # the body is read as sent, never inflated
    assert scraper.failures == 0


@pytest.mark.parametrize(
    "answer",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("garbage"),
        httpx.Response(500, text="Traceback (most recent call last): ..."),
        httpx.Response(401, json={"error": "unauthorized"}),
        httpx.Response(302, headers={"location": "http://169.254.169.254/latest/meta-data/"}),
    ],
    ids=["refused", "timeout", "protocol", "500", "401", "redirect"],
)
@respx.mock
async def test_a_failed_scrape_counts_and_keeps_the_last_numbers(client, answer):
    route = respx.get(f"{URL}/metrics")
    metadata = respx.get("http://169.254.169.254/latest/meta-data/").respond(200, text=GOOD)
    b = Backend(id="b", url=URL, healthy=True)
    scraper, samples = scraper_for(client, b)
    route.respond(200, text=GOOD)
    assert await scraper.scrape(b) is True
    if isinstance(answer, Exception):
        route.side_effect = answer
    else:
        route.side_effect = None
        route.return_value = answer
    assert await scraper.scrape(b) is False
    assert scraper.failures == 1
    assert samples.seen == [("b", 3.0, 2.0, True)], "the balancer keeps what it had"
    assert not metadata.called, "a redirect is never followed"


@pytest.mark.parametrize(
    "body",
    ["<html>metrics are elsewhere</html>", "", "lmdeploy:num_requests_running{engine=\"0\" 3\n", "lmdeploy:num_requests_running NaN\n", "\x00\xff" * 100],
    ids=["html", "empty", "truncated", "nan", "binary"],
)
@respx.mock
async def test_a_body_that_is_not_lmdeploy_metrics_is_ignored_not_an_error(client, body):
    respx.get(f"{URL}/metrics").respond(200, text=body)
    b = Backend(id="b", url=URL, healthy=True)
    scraper, samples = scraper_for(client, b)
    assert await scraper.scrape(b) is False
    assert samples.seen == [] and scraper.failures == 0


@respx.mock
async def test_only_healthy_backends_are_scraped_and_one_failure_does_not_stop_the_others(client):
    good = respx.get(f"{URL}/metrics").respond(200, text=GOOD)
    broken = respx.get("http://10.1.1.2:23333/metrics").mock(side_effect=httpx.ReadTimeout("slow"))
    resting = respx.get("http://10.1.1.3:23333/metrics").respond(200, text=GOOD)
    a = Backend(id="a", url=URL, healthy=True)
    b = Backend(id="b", url="http://10.1.1.2:23333", healthy=True)
    c = Backend(id="c", url="http://10.1.1.3:23333", healthy=False)
    scraper, samples = scraper_for(client, a, b, c)
    await scraper.scrape_all()
    assert good.call_count == 1 and broken.call_count == 1 and not resting.called
    assert [s[0] for s in samples.seen] == ["a"] and scraper.failures == 1


@respx.mock
async def test_an_endless_metrics_body_is_not_read_whole(client):
    from gateway.routing.signals import MAX_METRICS_BODY

    sent = 0

    async def endless():
        nonlocal sent
        line = b'lmdeploy:num_requests_running{engine="0"} 3\n' * 1024
        while sent < 64 * MAX_METRICS_BODY:  # bounded here too, should the reader never stop
            sent += len(line)
            yield line

    respx.get(f"{URL}/metrics").mock(return_value=httpx.Response(200, content=endless()))
    b = Backend(id="b", url=URL, healthy=True)
    scraper, samples = scraper_for(client, b)
    assert await scraper.scrape(b) is False
    assert scraper.failures == 1 and samples.seen == []
    assert sent <= MAX_METRICS_BODY + 64 * 1024, "stopped reading soon after the limit"
