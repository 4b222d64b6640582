"""The lean counter and histogram write the same exposition as prometheus_client's own for the same
updates: names, HELP, TYPE, labels, ``le`` strings, cumulative buckets, _count, _sum, _created."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prom_metrics

from gateway import metrics
from gateway.leanmetrics import LeanCounter, LeanHistogram

pytestmark = pytest.mark.unit

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_CREATED = re.compile(rb"^(\w+_created(?:\{[^}]*\})?) \S+$", re.M)


def _text(registry: CollectorRegistry) -> bytes:
    """The exposition with the _created timestamps blanked: each side stamps its own creation."""
    return _CREATED.sub(rb"\1 T", generate_latest(registry))


COUNTER_ROWS = [
    # (name, series: [(label values, [amounts])])
    ("no_series", []),
    ("one_inc", [(("chat", "2xx"), [1])]),
    ("token_counts", [(("chat", "2xx"), [7, 0, 3, 2**31 - 1]), (("embeddings", "4xx"), [1, 1])]),
    ("fractions", [(("chat", "5xx"), [0.5, 0.25, 1e-9])]),
    ("created_but_never_incremented", [(("chat", "2xx"), []), (("unrouted", "4xx"), [1])]),
]


@pytest.mark.parametrize("name,series", COUNTER_ROWS, ids=[r[0] for r in COUNTER_ROWS])
def test_counter_exposition_equals_prometheus_clients(name, series):
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    real = Counter("t_requests_total", "Requests, by route and status", ["route", "status"], registry=theirs)
    lean = LeanCounter("t_requests_total", "Requests, by route and status", ["route", "status"], registry=ours)
    for (route, status), amounts in series:
        a, b = real.labels(route=route, status=status), lean.labels(route=route, status=status)
        for amount in amounts:
            a.inc(amount)
            b.inc(amount)
    assert _text(ours) == _text(theirs)


HISTOGRAM_ROWS = [
    # (name, buckets, series: [(route, [observations])])
    ("no_series", LATENCY_BUCKETS, []),
    ("every_bound_exactly", LATENCY_BUCKETS, [("chat", [float(b) for b in LATENCY_BUCKETS])]),
    ("just_above_each_bound", LATENCY_BUCKETS, [("chat", [b * 1.000001 for b in LATENCY_BUCKETS])]),
    ("zero_negative_and_inf_bucket", LATENCY_BUCKETS, [("chat", [0.0, -1.0, 300.0001, 1e9, float("inf")])]),
    ("two_routes", LATENCY_BUCKETS, [("chat", [0.003, 0.2, 0.2, 7.5]), ("completions", [0.01, 61])]),
    ("int_bounds_and_explicit_inf", (1, 2, float("inf")), [("chat", [1, 2, 3, 0.5])]),
    ("a_bound_below_zero_has_no_sum", (-1, 0, 1), [("chat", [-2, -1, 0, 0.5, 5])]),
    ("created_but_never_observed", LATENCY_BUCKETS, [("chat", [])]),
]


@pytest.mark.parametrize("name,buckets,series", HISTOGRAM_ROWS, ids=[r[0] for r in HISTOGRAM_ROWS])
def test_histogram_exposition_equals_prometheus_clients(name, buckets, series):
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    real = Histogram("t_duration_seconds", "Seconds, by route", ["route"], buckets=buckets, registry=theirs)
    lean = LeanHistogram("t_duration_seconds", "Seconds, by route", ["route"], buckets=buckets, registry=ours)
    for route, values in series:
        a, b = real.labels(route=route), lean.labels(route=route)
        for v in values:
            a.observe(v)
            b.observe(v)
    assert _text(ours) == _text(theirs)


@pytest.mark.parametrize(
    "value,bucket",
    [(0.0, "0.005"), (0.005, "0.005"), (0.0051, "0.01"), (1, "1.0"), (1.0000001, "2.5"), (300, "300.0"), (300.5, "+Inf")],
)
def test_a_value_on_a_bound_lands_in_that_bucket(value, bucket):
    registry = CollectorRegistry()
    h = LeanHistogram("t_edge_seconds", "Edges", ["route"], buckets=LATENCY_BUCKETS, registry=registry)
    h.labels(route="chat").observe(value)
    first = min(i for i, le in enumerate(h._le) if registry.get_sample_value("t_edge_seconds_bucket", {"route": "chat", "le": le}) == 1)
    assert h._le[first] == bucket


def test_created_follows_prometheus_clients_switch():
    registry = CollectorRegistry()
    LeanCounter("t_switch_total", "Switch", ["route"], registry=registry).labels(route="a").inc()
    LeanHistogram("t_switch_seconds", "Switch", ["route"], buckets=(1,), registry=registry).labels(route="a").observe(1)
    assert registry.get_sample_value("t_switch_created", {"route": "a"}) > 1e9
    assert registry.get_sample_value("t_switch_seconds_created", {"route": "a"}) > 1e9
    prom_metrics.disable_created_metrics()
    try:
        assert b"_created" not in generate_latest(registry)
    finally:
        prom_metrics.enable_created_metrics()


def test_labels_must_be_exactly_the_declared_names():
    c = LeanCounter("t_names_total", "Names", ["route", "status"], registry=None)
    with pytest.raises(ValueError):
        c.labels(route="chat")
    with pytest.raises(ValueError):
        c.labels(route="chat", status="2xx", key="k")
    assert c.labels(route="chat", status="2xx") is c.labels(status="2xx", route="chat")


def test_the_registry_refuses_a_second_series_of_the_same_name():
    registry = CollectorRegistry(auto_describe=True)
    LeanHistogram("t_dup_seconds", "Dup", ["route"], buckets=(1,), registry=registry)
    with pytest.raises(ValueError):
        Counter("t_dup_seconds_count", "Dup", registry=registry)
    with pytest.raises(ValueError):
        LeanCounter("t_dup_seconds_sum", "Dup", [], registry=registry)


def test_the_gateways_hot_series_are_lean():
    from gateway.state import stats

    for m in (metrics.REQUESTS, metrics.LATENCY, metrics.TTFB, stats.USAGE_TOKENS, stats.USAGE_REQUESTS):
        assert isinstance(m, (LeanCounter, LeanHistogram))
