"""The ``balancer:`` section: which policy picks a backend, and the knobs of the expected-latency model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .fields import Section

# min_expected_latency is ours; the others are baselines for comparison (see gateway/routing/policies/).
POLICIES = ("min_expected_latency", "least_in_flight", "round_robin", "random", "least_load")
# What min_expected_latency minimises, from its predictions of TTFT and end-to-end latency:
# e2e + ttft_weight x TTFT (default); end-to-end latency among the backends whose TTFT is within
# ttft_slack of the best one's; end-to-end latency alone; TTFT alone.
OBJECTIVES = ("e2e_plus_ttft", "e2e_within_ttft", "e2e", "ttft")
# The gateway queue holds requests back on predictions, which only these policies make.
PREDICTING_POLICIES = ("min_expected_latency",)


# Priority classes of API keys (``auth.keys[].priority``): a name or a number 0-100; higher is served first.
PRIORITY_NAMES = {"batch": 0, "interactive": 10}
DEFAULT_PRIORITY = PRIORITY_NAMES["interactive"]


def parse_priority(value: Any) -> int | str:
    """A priority class as a number, or the problem with ``value`` as a message."""
    if isinstance(value, str) and value.strip().lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100:
        return value
    return f"{value!r} is not a priority class; use {' or '.join(PRIORITY_NAMES)}, or a number from 0 (lowest) to 100"


def priority_name(priority: int) -> str:
    """The class's name for metrics and messages: a named class by its name, any other by its number."""
    for name, value in PRIORITY_NAMES.items():
        if value == priority:
            return name
    return str(priority)


@dataclass(frozen=True)
class QueueConfig:
    """``balancer.queue``: the gateway-side queue per model (late binding, priorities, load shedding)."""

    enabled: bool = True
    hold_wait: float = 0.5  # seconds: when every backend would make a request wait longer than this for a batch slot or KV room, it waits in the gateway instead
    max_queued: int = 1024  # requests waiting per model; beyond, the lowest class is shed first
    max_wait: tuple[tuple[int, float], ...] = ((PRIORITY_NAMES["interactive"], 10.0), (PRIORITY_NAMES["batch"], 60.0))  # seconds a class may wait
    default_max_wait: float = 30.0  # for classes max_wait does not name
    quantum: int = 1024  # tokens a key may send per round within its class (deficit round robin)
    reserve: float = 0.75  # share of a backend's batch slots that classes below interactive leave free while interactive requests come (when the slots are known)
    kv_reserve: float = 0.85  # the same for its KV cache while its slots are unknown (a held-back flood never fills a batch, so they may never be learnt)
    pd_keep_share: float = 1.0  # keep_share for disaggregated (distserve) models, over their prefill and over their decode instances: lower, as their instances are even and the picker sends interactive requests to the one without batch work, so one that takes more than an even share stays kept; 0 turns it off
    keep_share: float = 1.5  # while interactive requests come, classes below interactive are not bound to a backend that took more than this many times an even share (1/N) of the recent interactive requests; 0 turns it off

    def wait_limit(self, priority: int) -> float:
        for p, w in self.max_wait:
            if p == priority:
                return w
        return self.default_max_wait


@dataclass(frozen=True)
class BalancerConfig:
    policy: str = "min_expected_latency"
    retries: int = 1  # extra attempts on another backend, only before any byte reached the client
    scrape_interval: float = 2.0  # seconds between /metrics polls of each backend; 0 turns scraping off
    affinity_bound: float = 1.0  # prefer the backend holding the prompt's prefix if its latency is within +100% of the best; 0 turns affinity off
    affinity_min_tokens: int = 64  # a shared prefix shorter than this does not count
    affinity_ttl: float = 600.0  # seconds after which a served prefix is assumed evicted from the backend's cache
    slow_start: float = 30.0  # seconds over which a backend back from ejection or unhealth ramps up to full share; 0 turns it off
    kv_penalty: float = 0.15  # seconds × k/(1-k), k = the backend's KV-cache usage (as in SGLang's least_load)
    others_weight: float = 1.5  # how much the delay a request adds to the others on a backend counts against it (0: none; above 1 for the requests that join the batch while it runs, which the estimate does not see)
    others_load: float = 0.15  # with the slots known, others_weight is multiplied by 1 + this × u/(1-u), u = b's batch slots taken (r's included, at most 0.9): the sequences that will join a nearly full batch while r runs; 0: none
    objective: str = "e2e_plus_ttft"
    ttft_weight: float = 8.0  # e2e_plus_ttft: seconds of end-to-end latency one second of TTFT is worth
    ttft_slack: float = 0.5  # e2e_within_ttft: seconds a request may start later than on the backend that would start it first, if that finishes it sooner
    tail_limit: float = 0.0  # seconds: a backend whose predicted latency for a request (its own, not the others') is above this and above 1.3x the best one's is not picked; 0: off (a p99-over-hit-rate trade, bench/routing/README.md)
    slots: int | None = None  # batch slots of each backend (LMDeploy's --max-batch-size), when known; unset: learnt from /metrics
    queue: QueueConfig = field(default_factory=QueueConfig)


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
        others_load=s.number("others_load", d.others_load, min=0, max=10),
        objective=s.enum("objective", OBJECTIVES, d.objective),
        ttft_weight=s.number("ttft_weight", d.ttft_weight, min=0, max=1000),
        ttft_slack=s.number("ttft_slack", d.ttft_slack, min=0, max=3600),
        tail_limit=s.number("tail_limit", d.tail_limit, min=0, max=86400),
        slots=s.int("slots", d.slots, min=1, max=1_000_000),
        queue=read_queue(s.section("queue")),
    )
    q = s.data.get("queue")
    if isinstance(q, dict) and q.get("enabled") is True and cfg.policy not in PREDICTING_POLICIES:
        s.error("queue.enabled", f"the gateway queue needs a policy that predicts waits ({', '.join(PREDICTING_POLICIES)}); policy is {cfg.policy!r}")
    if cfg.scrape_interval is not None and 0 < cfg.scrape_interval < 0.05:
        s.error("scrape_interval", f"{cfg.scrape_interval!r} is too short; use 0 (off) or at least 0.05 seconds")
    s.finish()
    return cfg


def read_queue(s: Section) -> QueueConfig:
    d = QueueConfig()
    waits = dict(d.max_wait)
    raw = s.raw("max_wait")
    if raw is not None:
        if not isinstance(raw, dict):
            s.error("max_wait", f"expected a mapping of priority class to seconds, e.g. {{interactive: 10, batch: 60}}; got {raw!r}")
        else:
            for cls, secs in raw.items():
                p = parse_priority(cls if not (isinstance(cls, str) and cls.strip().isdigit()) else int(cls))
                if isinstance(p, str):
                    s.error(f"max_wait.{cls}", p)
                elif isinstance(secs, bool) or not isinstance(secs, (int, float)) or not 0 < secs <= 3600:
                    s.error(f"max_wait.{cls}", f"{secs!r} is not a wait; use seconds > 0 and <= 3600")
                else:
                    waits[p] = float(secs)
    cfg = QueueConfig(
        enabled=s.bool("enabled", d.enabled),
        hold_wait=s.number("hold_wait", d.hold_wait, min=0, max=3600),
        max_queued=s.int("max_queued", d.max_queued, min=1, max=1_000_000),
        max_wait=tuple(sorted(waits.items(), reverse=True)),
        default_max_wait=s.number("default_max_wait", d.default_max_wait, min=0, max=3600, exclusive=True),
        quantum=s.int("quantum", d.quantum, min=1, max=1_000_000),
        reserve=s.number("reserve", d.reserve, min=0, max=0.9),
        kv_reserve=s.number("kv_reserve", d.kv_reserve, min=0, max=0.95),
        keep_share=s.number("keep_share", d.keep_share, min=0, max=100),
        pd_keep_share=s.number("pd_keep_share", d.pd_keep_share, min=0, max=100),
    )
    s.finish()
    return cfg
