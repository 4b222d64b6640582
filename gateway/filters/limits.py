"""Per-key rate limits: a token bucket per API key, decided from the headers (after auth).

``rate_limit_rpm: N`` on a key allows bursts of up to N requests and N per minute on average
(the bucket holds N tokens and refills at N/60 a second). A refused request gets 429 with
``Retry-After``. State is per gateway process.
"""

from __future__ import annotations

import math
import time

from ..config import AuthConfig
from ..errors import Refusal
from . import RequestContext


class RateLimit:
    def __init__(self, auth: AuthConfig, clock=time.monotonic):
        self._limits = {k.hash: float(k.rate_limit_rpm) for k in auth.keys if k.rate_limit_rpm}
        self._buckets: dict[str, tuple[float, float]] = {}  # key hash -> (tokens, last refill)
        self._clock = clock

    @property
    def active(self) -> bool:
        return bool(self._limits)

    def check(self, ctx: RequestContext) -> Refusal | None:
        key = ctx.key
        if key is None:
            return None
        rpm = self._limits.get(key.hash)
        if rpm is None:
            return None
        now = self._clock()
        tokens, last = self._buckets.get(key.hash, (rpm, now))
        tokens = min(rpm, tokens + (now - last) * rpm / 60.0)
        if tokens < 1.0:
            self._buckets[key.hash] = (tokens, now)
            wait = math.ceil((1.0 - tokens) * 60.0 / rpm)
            return Refusal(
                429,
                f"Rate limit of {rpm:g} requests per minute exceeded for this API key; retry in {wait} s.",
                "rate_limited",
                code="rate_limit_exceeded",
                headers=((b"retry-after", str(wait).encode()),),
            )
        self._buckets[key.hash] = (tokens - 1.0, now)
        return None
