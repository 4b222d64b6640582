"""Metrics of the state layer, in the gateway's registry.

Usage is labelled by key name and model: both come from configuration (key names are validated,
models are the ones the backends serve and the request was admitted for), never from free text.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from ..leanmetrics import CounterChild, LeanCounter
from ..metrics import REGISTRY

USAGE_TOKENS = LeanCounter("gateway_usage_tokens_total", "Tokens used, by key, model and kind (prompt or completion)", ["key", "model", "kind"], registry=REGISTRY)
USAGE_REQUESTS = LeanCounter("gateway_usage_requests_total", "Completed requests counted for usage, by key and model", ["key", "model", "estimated"], registry=REGISTRY)
LIMIT_REFUSALS = Counter("gateway_limit_refusals_total", "Requests refused by a per-key limit, by which limit", ["reason"], registry=REGISTRY)
STATE_DEGRADED = Gauge("gateway_state_degraded", "1 while the shared store (Redis) is unreachable and this replica runs on its local fallback", registry=REGISTRY)
STATE_ERRORS = Counter("gateway_state_errors_total", "Shared-store calls that failed or timed out, by operation", ["op"], registry=REGISTRY)
SETTLES_DROPPED = Counter("gateway_state_settles_dropped_total", "Usage and budget settles dropped because Redis was unreachable longer than the bounded queue holds", registry=REGISTRY)
KEY_RELOADS = Counter("gateway_key_reloads_total", "Key cache reloads, by source and result", ["source", "result"], registry=REGISTRY)

_children: dict[tuple[str, str], tuple[CounterChild, CounterChild, CounterChild, CounterChild]] = {}


def record_usage(key: str, model: str, prompt: int, completion: int, estimated: bool) -> None:
    found = _children.get((key, model))
    if found is None:
        found = _children[(key, model)] = (
            USAGE_TOKENS.labels(key=key, model=model, kind="prompt"),
            USAGE_TOKENS.labels(key=key, model=model, kind="completion"),
            USAGE_REQUESTS.labels(key=key, model=model, estimated="false"),
            USAGE_REQUESTS.labels(key=key, model=model, estimated="true"),
        )
    found[0].inc(prompt)
    found[1].inc(completion)
    found[3 if estimated else 2].inc()
