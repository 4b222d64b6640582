"""The ``state:`` section: where keys, limits, usage and shared load live.

Without ``redis_url`` everything is in this process's memory (one process, the quickstart).
With it, every replica and worker shares one Redis through ``redis.asyncio``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from .fields import Section


@dataclass(frozen=True)
class StateConfig:
    redis_url: str | None = None  # None: in-memory
    prefix: str = "gw"  # every Redis key starts with "<prefix>:"
    timeout: float = 0.5  # seconds, every Redis call; then the local fallback answers
    lease_ttl: float = 30.0  # a concurrency or load lease of a dead replica expires after this
    # Seconds between exchanges of in-flight counts (and what those requests hold) per backend with the
    # other replicas. 0.02, not 0.05: in the multi-replica replay (8 traces) 50-ms-old counts left four
    # replicas' TTFT p99 11% above one replica's (the slot-load term is steep near a full batch), 20 ms
    # level; the cost is per exchange (one pipelined round trip), not per request.
    load_interval: float = 0.02
    key_refresh: float = 30.0  # full reload of keys from the store, besides pub/sub invalidation
    usage_retention_days: int = 90
    default_max_tokens: int = 1024  # reserved for tpm when a request sets no max_tokens
    # Seconds a block of a key's quota granted to this process lives (state/grants.py): while a key
    # is far from its limits, admissions are decided here from it instead of one Redis call each.
    # 0: every admission is decided in Redis.
    grant_seconds: float = 0.5

    @property
    def shared(self) -> bool:
        return self.redis_url is not None


def read_state(s: Section) -> StateConfig:
    d = StateConfig()
    url = s.str("redis_url", None)
    if url is not None:
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            s.error("redis_url", f"{url.split('@')[-1][:60]!r} is not a Redis URL; expected redis://host:port/db, rediss://... or unix://path")
            url = None
    prefix = s.str("prefix", d.prefix)
    if prefix is not None and (len(prefix) > 32 or not prefix.replace("-", "").replace("_", "").isalnum()):
        s.error("prefix", f"{prefix!r} must be 1-32 letters, digits, '-' or '_'")
        prefix = d.prefix
    cfg = StateConfig(
        redis_url=url,
        prefix=prefix or d.prefix,
        timeout=s.number("timeout", d.timeout, min=0.01, max=10),
        lease_ttl=s.number("lease_ttl", d.lease_ttl, min=3, max=3600),
        load_interval=s.number("load_interval", d.load_interval, min=0.01, max=10),
        key_refresh=s.number("key_refresh", d.key_refresh, min=1, max=3600),
        usage_retention_days=s.int("usage_retention_days", d.usage_retention_days, min=1, max=3650),
        default_max_tokens=s.int("default_max_tokens", d.default_max_tokens, min=1, max=10_000_000),
        grant_seconds=s.number("grant_seconds", d.grant_seconds, min=0, max=10),
    )
    s.finish()
    return cfg
