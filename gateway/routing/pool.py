"""The cluster of backends: membership, active health checks and passive outlier ejection.

A ``Backend`` is one api_server base URL. The pool knows whether each is healthy (``/health``
read by ``parse_health``), draining, or ejected after consecutive failures. The balancer only
ever sees ``eligible(model)``. The pool knows nothing about processes nor about HTTP routing.

The pool is the one owner of every backend's health, launched ones included: only its checker
probes ``/health``, and others change a backend only through its methods (``add``, ``remove``,
``readmit``, ``mark_down``, ``drain``/``undrain``), never by writing fields. The launcher reads
``health_status`` to drive its instances and calls ``mark_down`` the moment a process exits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import httpx
import orjson

from ..config import HealthConfig
from ..upstream import control_call
from .periodic import Periodic

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.10
    from .._compat import timeout as _timeout

log = logging.getLogger("gateway.pool")

MAX_HEALTH_BODY = 4096  # a /health answer is a few bytes; a backend is not trusted to keep it so
MAX_MODELS_BODY = 1 << 20
MAX_MODELS = 1024
MAX_MODEL_ID = 256


def parse_health(status_code: int, body: bytes) -> str:
    """The one reading of api_server's ``/health``: ``"healthy"`` means in rotation, anything else not.

    lmdeploy answers 200 with an empty body (older) or ``{"status": ...}`` (``healthy``,
    ``sleeping``...); any other answer reads as ``http <code>``.
    """
    try:
        data = orjson.loads(body) if body.strip() else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("status"), str):
        status = "".join(c for c in data["status"][:32] if c.isalnum() or c in "_-") or "unknown"
        if status == "healthy" and status_code != 200:
            return f"http {status_code}"
        return status
    if status_code == 200 and data is None and not body.strip():
        return "healthy"
    return f"http {status_code}"


@dataclass(eq=False)
class Backend:
    """One api_server. ``id`` is internal: it appears in logs and metrics, never in responses."""

    id: str
    url: str
    api_key: str | None = None
    models: frozenset[str] = frozenset()
    static_models: bool = False  # models given in config; otherwise read from /v1/models
    origin: str = "static"  # "static" (config URL) or "launched"
    role: str = "hybrid"  # hybrid | prefill | decode (PD disaggregation: only the PD dispatcher uses the others)
    healthy: bool = False
    health_status: str = "unknown"  # last /health status, or "unreachable"
    draining: bool = False
    ejected_until: float = 0.0
    ejections: int = 0
    consecutive_failures: int = 0
    returned_at: float = 0.0  # when it last came back from ejection or unhealth: the balancer ramps it up slowly
    in_flight: int = 0
    check_interval: float | None = None  # its own /health interval (a launch group's); None: health.interval
    next_check: float = 0.0
    remote_in_flight: int = 0  # in flight through the other gateway replicas (the shared state store sums them)
    # What those requests hold, as their replicas' balancers count it (0 with remote_kv 0: not told):
    remote_kv: int = 0  # KV tokens (prompt + output) they reserve
    remote_decode: int = 0  # output tokens they have left
    remote_prefill: int = 0  # prompt tokens still to prefill
    slots: int | None = None  # its engine's batch slots when the gateway launched it (--max-batch-size); None: unknown

    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", b"Bearer " + self.api_key.encode())] if self.api_key else []

    def available(self, now: float) -> bool:
        return self.healthy and not self.draining and self.ejected_until <= now


class BackendPool:
    def __init__(self, health: HealthConfig, client: httpx.AsyncClient | None = None):
        self.health = health
        self._client = client
        self._backends: dict[str, Backend] = {}
        self._periodic = Periodic("health-checks", self._check_due, self._tick, log)
        # Told when a backend leaves the pool, so per-backend state elsewhere (policies) is dropped.
        self.on_removed: list[Callable[[Backend], None]] = []
        # Told of every change of membership, health, ejection or draining (the gateway queue wakes,
        # the state layer shares ejections with the other replicas).
        self._change_listeners: list[Callable[[Backend], None]] = []
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
            for fn in self.on_removed:
                try:
                    fn(b)
                except Exception:  # a listener must not break membership changes
                    log.exception("pool on_removed listener failed")
        return b

    def readmit(self, backend_id: str, url: str | None = None) -> Backend | None:
        """A backend starts afresh (a restarted process, maybe on a new port): past failures and
        ejections are forgotten; it returns to rotation at its next passing health check."""
        b = self._backends.get(backend_id)
        if b is None:
            return None
        if url is not None:
            b.url = url
        b.ejected_until = 0.0
        b.next_check = 0.0  # at the next tick
        b.ejections = 0
        b.consecutive_failures = 0
        self.set_health(b, False, "unknown")
        return b

    def mark_down(self, backend_id: str, status: str) -> None:
        """Out of rotation now (its process exited, say); a passing health check brings it back."""
        b = self._backends.get(backend_id)
        if b is not None:
            self.set_health(b, False, status)

    def undrain(self, backend_id: str) -> None:
        b = self._backends.get(backend_id)
        if b is not None:
            self.set_draining(b, False)

    async def drain(self, backend_id: str, timeout: float | None = None) -> bool:
        """No new requests; return True once its in-flight ones completed (False at timeout)."""
        b = self._backends.get(backend_id)
        if b is None:
            return True
        self.set_draining(b, True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while b.in_flight > 0:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)  # in_flight is counted per request elsewhere: poll, bounded by timeout
        return True

    def get(self, backend_id: str) -> Backend | None:
        return self._backends.get(backend_id)

    def __iter__(self):
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def on_change(self, fn: Callable[[Backend], None]) -> None:
        self._change_listeners.append(fn)

    def _changed(self, b: Backend) -> None:
        self._version += 1  # invalidates the healthy-models cache
        for fn in self._change_listeners:
            try:
                fn(b)
            except Exception:  # a listener must not break the pool's own bookkeeping
                log.exception("pool on_change listener failed")

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
            backoff = self.health.ejection_base * (2 ** min(b.ejections - 1, 6)) * random.uniform(0.9, 1.1)
            self._eject(b, backoff)
            log.warning(
                "backend %s ejected for %.1fs after repeated failures", b.id, backoff,
                extra={"fields": {"event": "backend_ejected", "backend": b.id, "seconds": round(backoff, 3), "ejections": b.ejections}},
            )

    def eject(self, backend_id: str, seconds: float) -> None:
        """Apply an ejection decided elsewhere (another replica) instead of writing fields.

        on_change listeners are told, as of any ejection: one that shares ejections must know this
        one came from outside (``ejections`` is unchanged by it) and not send it back.
        """
        b = self._backends.get(backend_id)
        if b is not None and seconds > 0 and time.monotonic() + seconds > b.ejected_until:
            self._eject(b, min(seconds, self.health.ejection_base * 64 * 1.1))  # never longer than our own worst

    def _eject(self, b: Backend, seconds: float) -> None:
        b.ejected_until = time.monotonic() + seconds
        b.returned_at = b.ejected_until  # the balancer ramps it up slowly from then on
        b.consecutive_failures = 0
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
        url = b.url
        try:
            async with _timeout(self.health.timeout):  # the whole probe, a slow-drip body included
                code, body = await self._get(f"{url}/health", headers, MAX_HEALTH_BODY)
            status = parse_health(code, body) if body is not None else "http oversized"
            healthy = status == "healthy"
            if healthy and (not b.static_models and (not b.models or not b.healthy)):
                async with _timeout(self.health.timeout):
                    models = await self._fetch_models(b, headers)
                if models is None:
                    healthy, status = False, "models_unavailable"
                elif models != b.models:
                    b.models = models
                    self._changed(b)
        except (httpx.HTTPError, OSError, asyncio.TimeoutError):
            healthy, status = False, "unreachable"
        if self._backends.get(b.id) is not b or b.url != url:
            return False  # removed or readmitted elsewhere while the probe was out: its answer is stale
        # A healthy probe does not lift an ejection: the backend returns when its backoff ends.
        self.set_health(b, healthy, status)
        return healthy

    async def _get(self, url: str, headers: dict[str, str], limit: int) -> tuple[int, bytes | None]:
        """GET with the body read up to ``limit`` bytes; None for a longer one (never read whole)."""
        return await control_call(self._client, "GET", url, headers=headers, limit=limit, timeout=self.health.timeout)  # type: ignore[arg-type]

    async def _fetch_models(self, b: Backend, headers: dict[str, str]) -> frozenset[str] | None:
        """The backend's model ids, bounded in bytes, count and length: they are served on /v1/models."""
        try:
            code, body = await self._get(f"{b.url}/v1/models", headers, MAX_MODELS_BODY)
            if code != 200 or body is None:
                return None
            data = orjson.loads(body).get("data", [])
            ids = [m["id"] for m in data[:MAX_MODELS] if isinstance(m, dict) and isinstance(m.get("id"), str)]
            return frozenset(i for i in ids if 0 < len(i) <= MAX_MODEL_ID and i.isprintable())
        except (httpx.HTTPError, OSError, orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
            return None

    def _tick(self) -> float:
        """The checker wakes at the shortest interval any backend asks for."""
        return min([self.health.interval, *(b.check_interval for b in self._backends.values() if b.check_interval)])

    async def _check_due(self) -> None:
        now = time.monotonic()
        due = [b for b in self._backends.values() if b.next_check <= now]
        for b in due:
            # Out of rotation, a backend is looked at at least every health.interval, to return soon.
            every = b.check_interval or self.health.interval
            every = every if b.healthy else min(every, self.health.interval)
            b.next_check = now + every * 0.85  # the tick's jitter (0.9-1.1) must not skip a due check
        await self.check_all(due) if due else None

    async def check_all(self, backends: Iterable[Backend] | None = None) -> None:
        await asyncio.gather(*(self.check(b) for b in (list(self._backends.values()) if backends is None else backends)))

    @property
    def checking(self) -> bool:
        """Whether the health checker runs (the launcher relies on it: it never probes itself)."""
        return self._periodic.running

    def start(self, client: httpx.AsyncClient | None = None) -> None:
        if client is not None:
            self._client = client
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
