"""The cluster of backends: membership, active health checks and passive outlier ejection.

A ``Backend`` is one api_server base URL. The pool knows whether each is healthy (its
``/health`` JSON says ``"healthy"``; 200 alone also means ``sleeping``), draining, or ejected
after consecutive failures. The balancer only ever sees ``eligible(model)``. The pool knows
nothing about processes (the launcher adds and removes backends) nor about HTTP routing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import httpx
import orjson

from ..config import HealthConfig
from .periodic import Periodic

log = logging.getLogger("gateway.pool")


@dataclass(eq=False)
class Backend:
    """One api_server. ``id`` is internal: it appears in logs and metrics, never in responses."""

    id: str
    url: str
    api_key: str | None = None
    models: frozenset[str] = frozenset()
    static_models: bool = False  # models given in config; otherwise read from /v1/models
    origin: str = "static"  # "static" (config URL) or "launched"
    healthy: bool = False
    health_status: str = "unknown"  # last /health status, or "unreachable"
    draining: bool = False
    ejected_until: float = 0.0
    ejections: int = 0
    consecutive_failures: int = 0
    returned_at: float = 0.0  # when it last came back from ejection or unhealth: the balancer ramps it up slowly
    in_flight: int = 0

    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", b"Bearer " + self.api_key.encode())] if self.api_key else []

    def available(self, now: float) -> bool:
        return self.healthy and not self.draining and self.ejected_until <= now


class BackendPool:
    def __init__(self, health: HealthConfig, client: httpx.AsyncClient | None = None):
        self.health = health
        self._client = client
        self._backends: dict[str, Backend] = {}
        self._periodic = Periodic("health-checks", self.check_all, lambda: self.health.interval, log)
        self._listeners: list[Callable[[Backend], None]] = []
        self._models_cache: tuple[int, frozenset[str]] | None = None
        self._version = 0

    # -- membership ---------------------------------------------------------------------------
    def add(self, backend: Backend) -> Backend:
        if backend.id in self._backends:
            raise ValueError(f"backend {backend.id!r} already in the pool")
        self._backends[backend.id] = backend
        self._changed(backend)
        return backend

    def remove(self, backend_id: str) -> Backend | None:
        b = self._backends.pop(backend_id, None)
        if b is not None:
            b.healthy = False
            self._changed(b)
        return b

    def get(self, backend_id: str) -> Backend | None:
        return self._backends.get(backend_id)

    def __iter__(self):
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def on_change(self, fn: Callable[[Backend], None]) -> None:
        self._listeners.append(fn)

    def _changed(self, b: Backend) -> None:
        self._version += 1
        for fn in self._listeners:
            try:
                fn(b)
            except Exception:  # a listener must not break health checking
                log.exception("pool listener failed")

    # -- queries used per request ---------------------------------------------------------------
    def eligible(self, model: str, now: float | None = None) -> list[Backend]:
        now = time.monotonic() if now is None else now
        return [b for b in self._backends.values() if model in b.models and b.available(now)]

    def knows_model(self, model: str) -> bool:
        return any(model in b.models for b in self._backends.values())

    def healthy_models(self) -> frozenset[str]:
        if self._models_cache is None or self._models_cache[0] != self._version:
            models: set[str] = set()
            for b in self._backends.values():
                if b.healthy and not b.draining:
                    models |= b.models
            self._models_cache = (self._version, frozenset(models))
        return self._models_cache[1]

    def any_healthy(self) -> bool:
        now = time.monotonic()
        return any(b.available(now) for b in self._backends.values())

    # -- state changes -----------------------------------------------------------------------------
    def set_draining(self, b: Backend, draining: bool) -> None:
        """A draining backend gets no new requests; those in flight finish."""
        if b.draining != draining:
            b.draining = draining
            log.info(
                "backend %s %s", b.id, "draining" if draining else "back in rotation",
                extra={"fields": {"event": "backend_drain", "backend": b.id, "draining": draining}},
            )
            self._changed(b)

    def set_health(self, b: Backend, healthy: bool, status: str) -> None:
        b.health_status = status
        if b.healthy != healthy:
            b.healthy = healthy
            if healthy:
                b.returned_at = time.monotonic()
                b.consecutive_failures = 0
            log.info(
                "backend %s is %s (%s)", b.id, "healthy" if healthy else "out of rotation", status,
                extra={"fields": {"event": "backend_health", "backend": b.id, "healthy": healthy, "status": status}},
            )
            self._changed(b)

    def report_success(self, b: Backend) -> None:
        b.consecutive_failures = 0

    def report_failure(self, b: Backend) -> None:
        """A connect error or a 5xx: passive outlier detection ejects after N in a row."""
        b.consecutive_failures += 1
        if b.consecutive_failures >= self.health.failures_to_eject and b.ejected_until <= time.monotonic():
            b.ejections += 1
            backoff = self.health.ejection_base * (2 ** min(b.ejections - 1, 6))
            b.ejected_until = time.monotonic() + backoff * random.uniform(0.9, 1.1)
            b.returned_at = b.ejected_until  # the balancer ramps it up slowly from then on
            b.consecutive_failures = 0
            log.warning(
                "backend %s ejected for %.1fs after repeated failures", b.id, backoff,
                extra={"fields": {"event": "backend_ejected", "backend": b.id, "seconds": round(backoff, 3), "ejections": b.ejections}},
            )
            self._changed(b)

    def report_unreachable(self, b: Backend) -> None:
        """A connection refused: the process is gone; stop sending to it until a health check says otherwise."""
        self.set_health(b, False, "unreachable")
        self.report_failure(b)

    # -- active health checks ----------------------------------------------------------------------
    async def check(self, b: Backend) -> bool:
        client = self._client
        assert client is not None, "pool has no HTTP client"
        headers = {"authorization": f"Bearer {b.api_key}"} if b.api_key else {}
        try:
            r = await client.get(f"{b.url}/health", headers=headers, timeout=self.health.timeout)
            status = "unhealthy"
            try:
                status = str(orjson.loads(r.content).get("status", "unhealthy"))
            except (orjson.JSONDecodeError, AttributeError):
                status = "healthy" if r.status_code == 200 and not r.content.strip() else "unhealthy"
            healthy = r.status_code == 200 and status == "healthy"
            if healthy and (not b.static_models and (not b.models or not b.healthy)):
                models = await self._fetch_models(b, headers)
                if models is None:
                    healthy, status = False, "models_unavailable"
                elif models != b.models:
                    b.models = models
                    self._changed(b)
        except (httpx.HTTPError, OSError, asyncio.TimeoutError):
            healthy, status = False, "unreachable"
        # A healthy probe does not lift an ejection: the backend returns when its backoff ends.
        self.set_health(b, healthy, status)
        return healthy

    async def _fetch_models(self, b: Backend, headers: dict[str, str]) -> frozenset[str] | None:
        try:
            r = await self._client.get(f"{b.url}/v1/models", headers=headers, timeout=self.health.timeout)  # type: ignore[union-attr]
            if r.status_code != 200:
                return None
            data = orjson.loads(r.content).get("data", [])
            return frozenset(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
        except (httpx.HTTPError, OSError, orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
            return None

    async def check_all(self, backends: Iterable[Backend] | None = None) -> None:
        await asyncio.gather(*(self.check(b) for b in (backends or list(self._backends.values()))))

    def start(self, client: httpx.AsyncClient | None = None) -> None:
        if client is not None:
            self._client = client
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
