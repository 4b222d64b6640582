"""The ``balancer:`` section: which policy picks a backend, and the knobs of the expected-latency model."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import Section

# min_expected_latency is ours; the others are baselines for comparison (see gateway/routing/policies/).
POLICIES = ("min_expected_latency", "least_in_flight", "round_robin", "random", "least_load")


@dataclass(frozen=True)
class BalancerConfig:
    policy: str = "min_expected_latency"
    retries: int = 1  # extra attempts on another backend, only before any byte reached the client
    scrape_interval: float = 2.0  # seconds between /metrics polls of each backend; 0 turns scraping off
    affinity_bound: float = 0.5  # prefer the backend holding the prompt's prefix if its latency is within +50% of the best; 0 turns affinity off
    affinity_min_tokens: int = 64  # a shared prefix shorter than this does not count
    affinity_ttl: float = 600.0  # seconds after which a served prefix is assumed evicted from the backend's cache
    slow_start: float = 30.0  # seconds over which a backend back from ejection or unhealth ramps up to full share; 0 turns it off
    kv_penalty: float = 0.15  # seconds × k/(1-k), k = the backend's KV-cache usage (as in SGLang's least_load)
    others_weight: float = 0.5  # how much the delay a request adds to the others on a backend counts against it (0: none)


def read_balancer(s: Section) -> BalancerConfig:
    d = BalancerConfig()
    cfg = BalancerConfig(
        policy=s.enum("policy", POLICIES, d.policy),
        retries=s.int("retries", d.retries, min=0, max=3),
        scrape_interval=s.number("scrape_interval", d.scrape_interval, min=0, max=3600),
        affinity_bound=s.number("affinity_bound", d.affinity_bound, min=0, max=10),
        affinity_min_tokens=s.int("affinity_min_tokens", d.affinity_min_tokens, min=1),
        affinity_ttl=s.number("affinity_ttl", d.affinity_ttl, min=0, exclusive=True),
        slow_start=s.number("slow_start", d.slow_start, min=0, max=3600),
        kv_penalty=s.number("kv_penalty", d.kv_penalty, min=0, max=3600),
        others_weight=s.number("others_weight", d.others_weight, min=0, max=10),
    )
    if cfg.scrape_interval is not None and 0 < cfg.scrape_interval < 0.05:
        s.error("scrape_interval", f"{cfg.scrape_interval!r} is too short; use 0 (off) or at least 0.05 seconds")
    s.finish()
    return cfg
