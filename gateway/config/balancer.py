"""The ``balancer:`` section: which policy picks a backend, and the gateway queue.

Seven settings. What the expected-latency model and the queue weigh (affinity, slow start, the
others' cost, the TTFT weight, the queue's reserves and shares, ...) are constants in the modules
that use them, each with the bench result that chose its value: ``RETIRED`` below says where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import Section
from .settings import read_fields, setting

# min_expected_latency is ours; the others are baselines for comparison (see gateway/routing/policies/).
POLICIES = ("min_expected_latency", "least_in_flight", "round_robin", "random", "least_load")
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


_POLICY_FILE = "gateway/routing/policies/expected_latency.py"
_QUEUE_FILE = "gateway/routing/queue.py"


def _constant(value: str, where: str) -> str:
    return f"an internal constant now ({value}), see {where}; remove this line"


@dataclass(frozen=True)
class QueueConfig:
    """The gateway-side queue per model: late binding, priority classes, fair shares among keys, load shedding."""

    RETIRED = {
        "hold_wait": _constant("0.5 s", _QUEUE_FILE + " (HOLD_WAIT)"),
        "quantum": _constant("1024 tokens", _QUEUE_FILE + " (QUANTUM)"),
        "reserve": _constant("0.75", _QUEUE_FILE + " (RESERVE)"),
        "kv_reserve": _constant("0.85", _QUEUE_FILE + " (KV_RESERVE)"),
        "keep_share": _constant("1.5", _QUEUE_FILE + " (KEEP_SHARE)"),
        "pd_keep_share": _constant("1.0", "gateway/routing/disagg.py (PD_KEEP_SHARE)"),
        "default_max_wait": "a class that max_wait does not name takes the wait of the nearest named class below it "
                            "(batch's by default); name the class in max_wait instead",
    }

    enabled: bool = setting(True, "Hold requests in the gateway while every backend is busy, serve higher classes first and shed what cannot start in time; turn off only to compare against no queue.")
    max_wait: tuple[tuple[int, float], ...] = setting(
        ((PRIORITY_NAMES["interactive"], 10.0), (PRIORITY_NAMES["batch"], 60.0)),
        "Seconds a request of each class may wait before it is refused (503 with Retry-After); an unnamed class takes the nearest named class below it.",
        custom={
            "type": "object",
            "propertyNames": {"anyOf": [{"enum": list(PRIORITY_NAMES)}, {"pattern": "^[0-9]{1,3}$"}]},
            "additionalProperties": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
            "default": {"interactive": 10, "batch": 60},
        },
        type_name="mapping of class to seconds", shown_default="`{interactive: 10, batch: 60}`")
    max_queued: int = setting(1024, "Requests that may wait per model; beyond, the newest of the lowest class makes room (raise it for large bursts).", min=1, max=1_000_000)

    def wait_limit(self, priority: int) -> float:
        """Seconds a request of this class may wait: its own entry in ``max_wait``, else the nearest
        named class below it, else (nothing below) the lowest named class's."""
        below = [(p, w) for p, w in self.max_wait if p <= priority]
        return max(below)[1] if below else min(self.max_wait)[1]


@dataclass(frozen=True)
class BalancerConfig:
    """How a backend is picked for each request, and the gateway queue."""

    RETIRED = {
        "affinity_bound": _constant("1.0", _POLICY_FILE + " (AFFINITY_BOUND)"),
        "affinity_min_tokens": _constant("64 tokens", _POLICY_FILE + " (AFFINITY_MIN_TOKENS)"),
        "affinity_ttl": _constant("600 s", _POLICY_FILE + " (AFFINITY_TTL)"),
        "slow_start": _constant("30 s", _POLICY_FILE + " (SLOW_START)"),
        "kv_penalty": _constant("0.15 s", "gateway/routing/policies/least_load.py (KV_PENALTY)"),
        "others_weight": _constant("1.5", _POLICY_FILE + " (OTHERS_WEIGHT)"),
        "others_load": _constant("0.15", _POLICY_FILE + " (OTHERS_LOAD)"),
        "ttft_weight": _constant("8", _POLICY_FILE + " (TTFT_WEIGHT)"),
        "objective": "the policy always minimises end-to-end latency + 8 x TTFT; remove this line",
        "ttft_slack": "it belonged to objective e2e_within_ttft, which is gone: the policy always minimises end-to-end latency + 8 x TTFT; remove this line",
        "tail_limit": "the opt-in tail guard (off by default) is gone; remove this line",
    }

    policy: str = setting("min_expected_latency", "How a backend is picked: `min_expected_latency` (ours, predicts each backend's latency); the others are baselines for comparison.", choices=POLICIES)
    retries: int = setting(1, "Extra attempts on another backend when one fails before any byte reached the client; 0 for none.", min=0, max=3)
    slots: int | None = setting(None, "Batch slots of each backend (LMDeploy's `--max-batch-size`): set it when you know it; unset, they are learnt from `/metrics` and late first bytes.", min=1, max=1_000_000)
    scrape_interval: float = setting(2.0, "Seconds between polls of each backend's `/metrics` (load and KV-cache gauges); 0 turns polling off.", min=0, max=3600)
    queue: QueueConfig = setting(doc="The gateway queue per model (min_expected_latency only, and distserve models whatever the policy).", default_factory=QueueConfig)


def read_balancer(s: Section) -> BalancerConfig:
    cfg = BalancerConfig(**read_fields(BalancerConfig, s), queue=read_queue(s.section("queue")))
    q = s.data.get("queue")
    if isinstance(q, dict) and q.get("enabled") is True and cfg.policy not in PREDICTING_POLICIES:
        s.error("queue.enabled", f"the gateway queue needs a policy that predicts waits ({', '.join(PREDICTING_POLICIES)}); policy is {cfg.policy!r}")
    if cfg.scrape_interval is not None and 0 < cfg.scrape_interval < 0.05:
        s.error("scrape_interval", f"{cfg.scrape_interval!r} is too short; use 0 (off) or at least 0.05 seconds")
    s.finish()
    return cfg


def read_queue(s: Section) -> QueueConfig:
    waits = dict(QueueConfig().max_wait)
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
    cfg = QueueConfig(**read_fields(QueueConfig, s), max_wait=tuple(sorted(waits.items(), reverse=True)))
    s.finish()
    return cfg
