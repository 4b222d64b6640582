"""Quota granted in blocks: admissions decided in this process while a key is far from its limits.

Deciding every admission in Redis costs a script run and a round trip per request, and most keys
are nowhere near their limits. So an admission that goes to Redis may also ask for a *grant*: a
block of the key's quota taken from Redis at once, for a short time (``state.grant_seconds``):

- ``requests`` rpm entries, pushed into the key's rpm log stamped at the grant's end (so they
  count in Redis from the moment they are granted until a minute after any of them can be used:
  the log never undercounts);
- ``tokens`` taken from the tpm bucket (each admission reserves from them; its settle gives back
  or takes the difference in Redis, as for any admission);
- ``slots`` concurrency leases (members of the key's lease set, like any lease).

Redis grants at most 1/``GRANT_FRACTION`` of what is left of each limit the key has, and only
when that is at least ``GRANT_MIN`` requests' worth for every one of them (and less than half a
budget is spent): a key near a limit is decided request by request, exactly as without grants.
Whatever is granted is counted in Redis, so the replicas together never admit more than a limit
allows; what a grant leaves unused goes back when it ends (``leftovers``), and its slots still
held by requests become ordinary leases, renewed and dropped one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ApiKeyConfig
from .limits import Decision

GRANT_FRACTION = 8  # a grant takes at most 1/8 of what is left of each limit (the Lua script's F)
GRANT_MIN = 8  # ... and is made only if that is at least 8 requests' worth of each
ASK_FIRST = 32  # requests asked for in a key's first grant in this process
ASK_MAX = 8192
SLOTS_FIRST = 16  # concurrency slots asked for in a key's first grant (then twice the most used at once)
SLOTS_MAX = 512


@dataclass(slots=True)
class Ask:
    """What one ADMIT call asks to be granted, beside its admissions."""

    key: ApiKeyConfig
    requests: int
    tokens: int
    slots: int
    grant_id: str  # the slots' lease ids are "<grant_id>.<n>"


@dataclass(slots=True, eq=False)
class Grant:
    key: ApiKeyConfig  # the key object granted for: an edited key is a new object and asks again
    requests: int  # rpm entries left (-1: the key has no rpm limit)
    tokens: int  # tpm tokens left (-1: no tpm limit)
    free: list[str]  # slots not in use (lease ids); [] with no concurrency cap
    slots: int  # slots granted (0: no concurrency cap)
    stamp: bytes  # the value of its rpm entries (Redis ms), to take back the unused ones
    until: float  # monotonic end
    started: float
    granted: int  # requests granted (or asked, with no rpm limit): sizes the next ask
    r: float  # Redis's levels after the grant (the headers' remaining = these + what is left here)
    k: float
    reset_ms: int
    tokens0: int = 0  # tokens granted
    taken: int = 0
    peak: int = 0  # most slots in use at once: sizes the next ask for slots
    renewing: bool = False  # the next grant is asked for
    exhausted: bool = False  # an admission found its requests or tokens spent
    ended: bool = False
    busy: set[str] = field(default_factory=set)

    def take(self, reserve: int, now: float) -> str | None:
        """One admission from this grant: its lease id ("" without a concurrency cap), or None when
        it does not fit (the admission then goes to Redis)."""
        if now >= self.until:
            return None
        if self.requests == 0 or (self.tokens >= 0 and self.tokens < reserve):
            self.exhausted = True
            return None
        lease = ""
        if self.slots:
            if not self.free:
                return None
            lease = self.free.pop()
            busy = self.busy
            busy.add(lease)
            if len(busy) > self.peak:
                self.peak = len(busy)
        if self.requests > 0:
            self.requests -= 1
        if self.tokens >= 0:
            self.tokens -= reserve
        self.taken += 1
        return lease

    def decision(self, now: float) -> Decision:
        """The headers' view after a take: Redis's levels at the grant plus what is left here."""
        return Decision(
            True,
            requests_left=self.r + self.requests if self.requests >= 0 else -1.0,
            tokens_left=self.k + self.tokens if self.tokens >= 0 else -1.0,
            requests_reset_ms=max(0, self.reset_ms - int((now - self.started) * 1000)) if self.requests >= 0 else 0,
        )

    def release(self, lease: str) -> bool:
        """A request's slot back: True when the grant is still live and took it (nothing to tell
        Redis), False when it has ended (the lease is then an ordinary one, dropped in Redis)."""
        if lease not in self.busy:
            return False
        self.busy.discard(lease)
        if self.ended:
            return False
        self.free.append(lease)
        return True

    def renew_due(self, now: float) -> bool:
        """Time to ask for the next grant, before this one runs out: three quarters of its requests
        or of its life gone (the next is then granted before any admission has to go to Redis)."""
        return self.taken * 4 >= self.granted * 3 or now - self.started >= (self.until - self.started) * 0.75

    def next_ask(self, now: float, life: float) -> tuple[int, int]:
        """(requests, slots) to ask for next: this grant's rate over a whole life, with half again
        to spare (twice what it had when it ran out); slots for twice the most in use at once."""
        rate = self.taken / max(now - self.started, 0.001)
        requests = int(rate * life * 1.5) + 1
        if self.exhausted:
            requests = max(requests, 2 * self.granted)
        return min(ASK_MAX, max(GRANT_MIN, requests)), min(SLOTS_MAX, max(SLOTS_FIRST, 2 * self.peak))

    def reserve_each(self) -> int:
        """The tokens its admissions reserved on average (what the next ask asks per request)."""
        return max(1, (self.tokens0 - self.tokens) // self.taken) if self.taken and self.tokens >= 0 else 1
