"""Tracing with an in-memory exporter: one span per request, children for the filters, the pick
and the upstream call, and the upstream span's W3C traceparent at the backend."""

from __future__ import annotations

import re

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import TracingConfig
from gateway.tracing import Tracing
from support import gateway_with_sims

pytestmark = pytest.mark.e2e

MODEL = "test-model"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


def traced(gw, **config):
    exporter = InMemorySpanExporter()
    gw.gateway.asgi().tracer = Tracing(TracingConfig(enabled=True, **config), exporter=exporter)
    return exporter


@pytest.fixture(scope="module")
def setup(keys):
    with gateway_with_sims(keys, 1) as (gw, sims):
        yield gw, sims[0], keys


def chat(gw, keys, **headers):
    return httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {keys.alice}", **headers},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )


def test_one_request_is_one_trace_with_filter_pick_and_upstream_children(setup):
    gw, sim, keys = setup
    exporter = traced(gw)
    sim.clear()
    r = chat(gw, keys, traceparent=CLIENT_PARENT)
    assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["POST /v1/chat/completions"]
    assert set(spans) == {"POST /v1/chat/completions", "filter.auth", "filter.body", "filter.media", "filter.limits", "pick", "upstream"}
    assert root.parent is None  # the client's traceparent is not trusted by default
    assert format(root.context.trace_id, "032x") != CLIENT_TRACE
    for name in ("filter.auth", "filter.body", "filter.media", "filter.limits", "pick", "upstream"):
        assert spans[name].parent.span_id == root.context.span_id and spans[name].context.trace_id == root.context.trace_id
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gateway.backend"] == "sim-0" and root.attributes["gateway.request_id"] == r.headers["x-request-id"]
    assert spans["upstream"].attributes["gateway.backend"] == "sim-0"

    # The backend sees the upstream span as its parent, never the client's own traceparent.
    sent = sim.requests()[-1]["headers"]["traceparent"]
    m = TRACEPARENT.match(sent)
    assert m and m.group(1) == format(root.context.trace_id, "032x") and m.group(2) == format(spans["upstream"].context.span_id, "016x")


def test_a_trusted_valid_client_traceparent_becomes_the_parent(setup):
    gw, sim, keys = setup
    exporter = traced(gw, trust_client_traceparent=True)
    assert chat(gw, keys, traceparent=CLIENT_PARENT).status_code == 200
    root = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")][0]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE and root.parent.span_id == 0xB7AD6B7169203331


def test_a_malformed_client_traceparent_is_ignored_and_never_forwarded(setup):
    gw, sim, keys = setup
    exporter = traced(gw, trust_client_traceparent=True)
    sim.clear()
    assert chat(gw, keys, traceparent="00-zz-not-a-trace-01").status_code == 200
    roots = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    assert len(roots) == 1 and roots[0].parent is None
    for req in sim.requests():
        assert "not-a-trace" not in req["headers"].get("traceparent", "")


def test_a_refused_request_is_a_span_with_its_reason_and_no_upstream(setup):
    gw, sim, keys = setup
    exporter = traced(gw)
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-wrong"}, json={})
    assert r.status_code == 401
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["filter.auth", "POST /v1/chat/completions"]
    assert spans[1].attributes["gateway.refusal"] == "invalid_api_key"


def test_tracing_off_sends_no_traceparent(setup):
    gw, sim, keys = setup
    gw.gateway.asgi().tracer = None
    sim.clear()
    assert chat(gw, keys, traceparent=CLIENT_PARENT).status_code == 200
    assert "traceparent" not in sim.requests()[-1]["headers"]
