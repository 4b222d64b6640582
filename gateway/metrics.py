"""Prometheus metrics of the gateway, in one registry per process.

Labels are low-cardinality by design: route kind, reason strings, backend ids. Never keys, URLs
or model names chosen by clients (a client could blow up the series count).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .leanmetrics import LeanCounter, LeanHistogram

REGISTRY = CollectorRegistry(auto_describe=True)

# The series updated on every forwarded request are lean (no lock, no validation per update; see
# leanmetrics); the exposition is the same as prometheus_client's.
REQUESTS = LeanCounter("gateway_requests_total", "Requests answered, by route kind and status class", ["route", "status"], registry=REGISTRY)
REFUSALS = Counter("gateway_refusals_total", "Requests refused by a filter, by reason", ["reason"], registry=REGISTRY)
MEDIA_REFUSALS = Counter("gateway_media_refusals_total", "Media URLs refused by the media policy, by reason", ["reason"], registry=REGISTRY)
UPSTREAM_ERRORS = Counter("gateway_upstream_errors_total", "Failures talking to a backend, by kind", ["backend", "kind"], registry=REGISTRY)
RETRIES = Counter("gateway_retries_total", "Requests retried on another backend before any byte reached the client", ["reason"], registry=REGISTRY)
CLIENT_DISCONNECTS = Counter("gateway_client_disconnects_total", "Requests whose client went away; the upstream request was cancelled", registry=REGISTRY)
QUEUE_WAITING = Gauge("gateway_queue_waiting", "Requests waiting in the gateway queue for a backend to free capacity", registry=REGISTRY)
# reason: predicted (on arrival), queue_full, displaced (by a higher class), deadline (waited max_wait)
QUEUE_SHED = Counter("gateway_queue_shed_total", "Requests the gateway queue refused (503/429), by priority class, why and model", ["priority", "reason", "model"], registry=REGISTRY)
QUEUE_WAIT = Histogram(
    "gateway_queue_wait_seconds",
    "Seconds a request waited in the gateway queue before it was sent to a backend",
    ["priority"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)
AFFINITY_PICKS = Counter("gateway_affinity_picks_total", "Picks where prefix affinity chose a backend other than the lowest expected latency", registry=REGISTRY)
IN_FLIGHT = Gauge("gateway_backend_in_flight", "Requests in flight per backend", ["backend"], registry=REGISTRY)
BACKEND_HEALTHY = Gauge("gateway_backend_healthy", "1 when the backend is in rotation", ["backend"], registry=REGISTRY)
LATENCY = LeanHistogram(
    "gateway_request_duration_seconds",
    "Time from request to the end of the response, by route kind",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
TTFB = LeanHistogram(
    "gateway_time_to_first_byte_seconds",
    "Time from dispatch to the first upstream byte, by route kind",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
# The launcher's instances (gateway/launcher), beside the backends they become.
LAUNCHED_STATE = Gauge("gateway_launched_instance_state", "1 for the state each launched instance is in", ["instance", "state"], registry=REGISTRY)
LAUNCHED_RESTARTS = Counter("gateway_launched_instance_restarts_total", "Restarts of each launched instance", ["instance"], registry=REGISTRY)
