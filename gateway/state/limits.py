"""Per-key limits decided in one step: requests/minute, tokens/minute, concurrency and budget.

Both stores decide with the same rules; Redis runs them in one Lua script (``redis.py``), the
in-memory store and the Redis fallback run ``LocalLimiter`` below.

- rpm is a sliding log of the admissions of the last 60 s: never more than rpm in any minute.
- tpm is a token bucket (capacity = the limit, refilled at limit/60 a second). A request
  reserves ``prompt estimate + max_tokens`` from it; when it ends the reservation is settled against the real usage (the difference is
  given back, or taken if it ran over), so concurrent streams cannot overshoot the limit.
- concurrency is a set of leases with an expiry; the lease is dropped at the end of the request
  and expires on its own if the replica holding it dies.
- the budget is a token counter per period (day, month or total); spent means 429
  ``insufficient_quota``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable
from dataclasses import dataclass, field

from ..config import ApiKeyConfig
from ..errors import Refusal

WINDOW_MS = 60_000


@dataclass(slots=True)
class Decision:
    ok: bool
    reason: str = ""  # rpm | tpm | too_big | concurrency | budget
    retry_ms: int = 0
    requests_left: float = -1.0  # bucket levels after this request (-1: no such limit)
    tokens_left: float = -1.0
    requests_reset_ms: int = 0  # until the oldest admission of the last minute leaves the window


@dataclass(slots=True)
class Admission:
    """One admitted request, until it is settled."""

    key: ApiKeyConfig
    model: str
    reserved: int  # tokens taken from the tpm bucket at admission
    prompt_estimate: int | Callable[[], int]  # a callable: estimated only if the response has no usage
    lease: str  # concurrency lease id ("" when the key has no concurrency cap)
    shared: bool  # decided by the shared store (False: by this process's fallback)
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    settled: bool = False
    grant: Any = None  # the grant it was admitted from (state/grants.py), if any


def period_id(period: str, now: float | None = None) -> str:
    t = time.gmtime(now if now is not None else time.time())
    if period == "day":
        return time.strftime("%Y%m%d", t)
    if period == "month":
        return time.strftime("%Y%m", t)
    return "total"


_CURRENT: dict[str, tuple[int, str]] = {}  # period -> (the second it was computed in, its id)


def current_period_id(period: str) -> str:
    """``period_id`` of now, computed once a second (the limits ask for it on every request, and
    gmtime + strftime cost more than the rest of a budget check). Periods start on whole seconds."""
    sec = int(time.time())
    hit = _CURRENT.get(period)
    if hit is not None and hit[0] == sec:
        return hit[1]
    pid = period_id(period, sec)
    _CURRENT[period] = (sec, pid)
    return pid


def period_seconds_left(period: str, now: float | None = None) -> int:
    """How long the current period's counter must be kept (0: forever)."""
    now = now if now is not None else time.time()
    if period == "day":
        return int(86400 - now % 86400) + 3600
    if period == "month":
        return 32 * 86400
    return 0


_DURATIONS: dict[int, bytes] = {}  # tenths of a second -> text: two per admitted request, from a few hundred values


def _duration(ms: float) -> bytes:
    """OpenAI's reset format: 250ms, 1.5s, 6m0s (in integer tenths of a second: float rounding and
    formatting cost more than the rest of the headers)."""
    if ms < 1000:
        return b"%dms" % math.ceil(ms) if ms > 0 else b"0ms"
    tenths = int(ms + 50) // 100
    text = _DURATIONS.get(tenths)
    if text is None:
        minutes, rest = divmod(tenths, 600)
        sec, tenth = divmod(rest, 10)
        text = (b"%dm" % minutes if minutes else b"") + (b"%d.%ds" % (sec, tenth) if tenth else b"%ds" % sec)
        if len(_DURATIONS) < 100_000:  # bounded: a reset past ~2.7 h is formatted each time
            _DURATIONS[tenths] = text
    return text


_LIMIT_HEADERS: dict[tuple[int, int], tuple[tuple[bytes, bytes], ...]] = {}


def rate_headers(key: ApiKeyConfig, d: Decision, share: int = 1) -> list[tuple[bytes, bytes]]:
    """The x-ratelimit-* headers the OpenAI SDK reads (only for the limits the key has)."""
    rpm, tpm = key.rate_limit_rpm or 0, key.rate_limit_tpm or 0
    fixed = _LIMIT_HEADERS.get((rpm, tpm))
    if fixed is None:
        fixed = _LIMIT_HEADERS[(rpm, tpm)] = (
            (b"x-ratelimit-limit-requests", str(rpm).encode()),
            (b"x-ratelimit-limit-tokens", str(tpm).encode()),
        )
        if len(_LIMIT_HEADERS) > 10_000:  # bounded: limits come from keys, but keys can be edited live
            _LIMIT_HEADERS.clear()
    out: list[tuple[bytes, bytes]] = []
    if rpm:
        out += (
            fixed[0],
            (b"x-ratelimit-remaining-requests", b"%d" % d.requests_left if d.requests_left > 0 else b"0"),
            (b"x-ratelimit-reset-requests", _duration(d.requests_reset_ms)),
        )
    if tpm:
        cap = max(1, tpm // share)
        left = d.tokens_left if d.tokens_left > 0 else 0.0
        out += (
            fixed[1],
            (b"x-ratelimit-remaining-tokens", b"%d" % left if left else b"0"),
            (b"x-ratelimit-reset-tokens", _duration((cap - left) * WINDOW_MS / cap)),
        )
    return out


def refusal_for(key: ApiKeyConfig, d: Decision, reserve: int, share: int = 1) -> Refusal:
    headers = rate_headers(key, d, share)
    if d.reason == "budget":
        return Refusal(
            429,
            f"This API key's token budget for the {key.budget_period if key.budget_period != 'total' else 'key'} is spent.",
            "budget_spent",
            code="insufficient_quota",
            type="insufficient_quota",
            headers=tuple(headers),
        )
    if d.reason == "too_big":
        return Refusal(
            429,
            f"This request may use up to {reserve} tokens, more than this API key's limit of {key.rate_limit_tpm} tokens per minute; lower max_tokens.",
            "request_over_tpm",
            param="max_tokens",
            code="rate_limit_exceeded",
            headers=tuple(headers),
        )
    wait_s = max(1, math.ceil(d.retry_ms / 1000))
    headers += [(b"retry-after", str(wait_s).encode()), (b"retry-after-ms", str(max(1, d.retry_ms)).encode())]
    if d.reason == "concurrency":
        message = f"This API key already has {key.max_concurrent} requests in flight, its limit; retry when one ends."
        reason = "concurrency_limited"
    elif d.reason == "tpm":
        message = f"Rate limit of {key.rate_limit_tpm} tokens per minute exceeded for this API key; retry in {wait_s} s."
        reason = "token_rate_limited"
    else:
        message = f"Rate limit of {key.rate_limit_rpm} requests per minute exceeded for this API key; retry in {wait_s} s."
        reason = "rate_limited"
    return Refusal(429, message, reason, code="rate_limit_exceeded", headers=tuple(headers))


class LocalLimiter:
    """The rules in this process's memory (the in-memory store, and Redis's fallback).

    ``share`` divides every limit: with Redis down, each of N live replicas allows 1/N.
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (hash, "t") -> (level, at)
        self._log: dict[str, deque[float]] = {}  # hash -> admission times of the last minute
        self._leases: dict[str, dict[str, float]] = {}  # hash -> lease id -> expiry
        self._budget: dict[tuple[str, str], int] = {}  # (hash, period id) -> tokens used
        self._lease_ttl = 3600.0

    def _level(self, k: tuple[str, str], cap: float, now: float) -> float:
        found = self._buckets.get(k)
        if found is None:
            return cap
        level, at = found
        return min(cap, level + (now - at) * cap / 60.0)

    def admit(self, key: ApiKeyConfig, reserve: int, lease: str, share: int = 1) -> Decision:
        now = self._clock()
        h = key.hash
        rpm = max(1, key.rate_limit_rpm // share) if key.rate_limit_rpm else 0
        tpm = max(1, key.rate_limit_tpm // share) if key.rate_limit_tpm else 0
        r_level, reset_ms = -1.0, 0
        if rpm:
            log = self._log.setdefault(h, deque())
            while log and log[0] <= now - 60.0:
                log.popleft()
            r_level = float(rpm - len(log))
            reset_ms = math.ceil((log[0] + 60.0 - now) * 1000) if log else 0
        t_level = self._level((h, "t"), tpm, now) if tpm else -1.0
        d = Decision(False, requests_left=r_level, tokens_left=t_level, requests_reset_ms=reset_ms)
        if key.budget_tokens:
            used = self._budget.get((h, current_period_id(key.budget_period)), 0)
            if used >= max(1, key.budget_tokens // share):
                d.reason = "budget"
                return d
        if rpm and r_level < 1:
            d.reason, d.retry_ms = "rpm", max(1, reset_ms)
            return d
        if tpm:
            if reserve > tpm:
                d.reason = "too_big"
                return d
            if t_level < reserve:
                d.reason, d.retry_ms = "tpm", math.ceil((reserve - t_level) * WINDOW_MS / tpm)
                return d
        if key.max_concurrent:
            leases = self._leases.setdefault(h, {})
            cap = max(1, key.max_concurrent // share)
            if len(leases) >= cap:  # only then is it worth dropping expired ones
                for lid in [lid for lid, exp in leases.items() if exp <= now]:
                    del leases[lid]
            if len(leases) >= cap:
                d.reason, d.retry_ms = "concurrency", 1000
                return d
            leases[lease] = now + self._lease_ttl
        if rpm:
            r_level -= 1
            log.append(now)
            reset_ms = reset_ms or WINDOW_MS
        if tpm:
            t_level -= reserve
            self._buckets[(h, "t")] = (t_level, now)
        return Decision(True, requests_left=r_level, tokens_left=t_level, requests_reset_ms=reset_ms)

    def settle(self, key: ApiKeyConfig, reserved: int, used: int, lease: str, share: int = 1) -> None:
        now = self._clock()
        h = key.hash
        if key.rate_limit_tpm and reserved != used:
            tpm = max(1, key.rate_limit_tpm // share)
            level = self._level((h, "t"), tpm, now)
            self._buckets[(h, "t")] = (min(tpm, level + reserved - used), now)
        if lease:
            self._leases.get(h, {}).pop(lease, None)
        if key.budget_tokens and used > 0:
            pid = (h, current_period_id(key.budget_period))
            self._budget[pid] = self._budget.get(pid, 0) + used
