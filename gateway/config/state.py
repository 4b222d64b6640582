"""The ``state:`` section: where keys, limits, usage and shared load live.

Without ``redis_url`` everything is in this process's memory (one process, the quickstart).
With it, every replica and worker shares one Redis through ``redis.asyncio``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from .fields import Section
from .settings import read_fields, setting


@dataclass(frozen=True)
class StateConfig:
    """Where keys, limits, usage and the shared load live: this process's memory, or one Redis."""

    redis_url: str | None = setting(None, "`redis://host:port/db`, `rediss://...` or `unix://path`: every replica and worker shares it; unset: in memory (one process).")
    prefix: str = setting("gw", "Every Redis key starts with `<prefix>:` (1-32 letters, digits, `-`, `_`), so gateways can share a Redis.")
    timeout: float = setting(0.5, "Seconds for every Redis call; then the local fallback answers.", min=0.01, max=10)
    lease_ttl: float = setting(30.0, "Seconds after which a dead replica's concurrency and load leases expire.", min=3, max=3600)
    # 0.02, not 0.05: in the multi-replica replay (8 traces) 50-ms-old counts left four replicas'
    # TTFT p99 11% above one replica's; the cost is one pipelined round trip per exchange.
    load_interval: float = setting(0.02, "Seconds between exchanges of in-flight counts per backend with the other replicas.", min=0.01, max=10)
    key_refresh: float = setting(30.0, "Seconds between full reloads of the keys from the store (changes also arrive by pub/sub).", min=1, max=3600)
    usage_retention_days: int = setting(90, "Days of hourly usage rows kept.", min=1, max=3650)
    default_max_tokens: int = setting(1024, "Tokens reserved against `rate_limit_tpm` for a request that sets no `max_tokens`.", min=1, max=10_000_000)
    # state/grants.py: while a key is far from its limits, admissions are decided here instead of one Redis call each.
    grant_seconds: float = setting(0.5, "Seconds a block of a key's quota granted to this process lives; 0: every admission is decided in Redis.", min=0, max=10)

    @property
    def shared(self) -> bool:
        return self.redis_url is not None


def read_state(s: Section) -> StateConfig:
    d = StateConfig()
    v = read_fields(StateConfig, s)
    url = v["redis_url"]
    if url is not None:
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            s.error("redis_url", f"{url.split('@')[-1][:60]!r} is not a Redis URL; expected redis://host:port/db, rediss://... or unix://path")
            url = None
    prefix = v["prefix"]
    if prefix is not None and (len(prefix) > 32 or not prefix.replace("-", "").replace("_", "").isalnum()):
        s.error("prefix", f"{prefix!r} must be 1-32 letters, digits, '-' or '_'")
        prefix = d.prefix
    cfg = StateConfig(**{**v, "redis_url": url, "prefix": prefix or d.prefix})
    s.finish()
    return cfg
