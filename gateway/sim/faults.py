"""Health state and one-shot faults, set at runtime through ``POST /_sim/control``.

Faults hit only inference requests (the POST routes that generate), so health checks, model
listings and metric scrapes from the gateway never use them up. When several are armed, the
order is drop, hang, fail; a stream crash is taken by the next streaming request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HEALTH_STATES = ("healthy", "sleeping", "initializing", "unhealthy")
_HEALTH_MESSAGES = {
    "healthy": "Engine is healthy.",
    "sleeping": "Engine is sleeping.",
    "initializing": "Engine is initializing.",
    "unhealthy": "Engine is unhealthy.",
}


class Health:
    def __init__(self) -> None:
        self._status = "healthy"
        self._initializing_until = 0.0

    def start(self, now: float, initializing_for: float) -> None:
        self._initializing_until = now + initializing_for

    def status(self, now: float) -> str:
        if now < self._initializing_until and self._status == "healthy":
            return "initializing"
        return self._status

    def set(self, status: str) -> None:
        self._status = status
        self._initializing_until = 0.0  # an explicit state wins over the start-up window

    def snapshot(self, now: float) -> tuple[int, dict[str, str]]:
        status = self.status(now)
        # lmdeploy: 200 for healthy and sleeping, 503 otherwise; routers must read the body.
        code = 200 if status in ("healthy", "sleeping") else 503
        return code, {"status": status, "message": _HEALTH_MESSAGES[status]}


@dataclass(slots=True)
class Failure:
    remaining: int
    status: int
    body: Any | None  # None: an error body in the route's own shape


DROP, HANG, FAIL = "drop", "hang", "fail"


@dataclass(slots=True)
class Faults:
    fail: Failure | None = None
    drop: int = 0
    hang: int = 0
    crash_after: int | None = None
    applied: dict[str, int] = field(default_factory=lambda: {DROP: 0, HANG: 0, FAIL: 0, "crash": 0})

    def take(self) -> tuple[str, Failure | None] | None:
        """The fault for the next inference request, used up by taking it; None: serve normally."""
        if self.drop:
            self.drop -= 1
            return self._applied(DROP, None)
        if self.hang:
            self.hang -= 1
            return self._applied(HANG, None)
        fail = self.fail
        if fail is not None:
            fail.remaining -= 1
            if fail.remaining <= 0:
                self.fail = None
            return self._applied(FAIL, fail)
        return None

    def take_crash(self) -> int | None:
        after, self.crash_after = self.crash_after, None
        if after is not None:
            self.applied["crash"] += 1
        return after

    def clear(self) -> None:
        self.fail, self.drop, self.hang, self.crash_after = None, 0, 0, None

    def armed(self) -> dict[str, Any]:
        return {
            "fail_next": None if self.fail is None else {"count": self.fail.remaining, "status": self.fail.status, "body": self.fail.body},
            "drop_next": self.drop,
            "hang_next": self.hang,
            "crash_stream_after": self.crash_after,
        }

    def _applied(self, kind: str, failure: Failure | None) -> tuple[str, Failure | None]:
        self.applied[kind] += 1
        return kind, failure
