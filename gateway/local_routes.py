"""The routes the gateway answers itself: ``/health``, ``/ready``, ``/v1/models``, ``/metrics``.

A terminal filter, like Envoy's direct responses: the listener hands it an authenticated
request whose route is not forwarded, and it writes the whole answer. It reads the pool (and
the launcher, when there is one) and never the listener or the wiring.
"""

from __future__ import annotations

import time
from typing import Protocol

from prometheus_client import generate_latest

from . import metrics
from .errors import Refusal, model_not_found
from .filters import RequestContext
from .responses import Send, refuse, send_json
from .routes import MODEL_PREFIX
from .routing.pool import BackendPool

METRICS_FORBIDDEN = Refusal(403, "This API key may not read the gateway's metrics (it needs `admin: true`).", "not_admin", code="permission_denied")
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4"


class LauncherStatus(Protocol):
    def failed_count(self) -> int: ...

    def update_metrics(self) -> None: ...


def render_metrics(pool: BackendPool, launcher: LauncherStatus | None) -> bytes:
    """The Prometheus text, with the per-backend gauges brought up to date first."""
    now = time.monotonic()
    for b in pool:
        metrics.IN_FLIGHT.labels(backend=b.id).set(b.in_flight)
        metrics.BACKEND_HEALTHY.labels(backend=b.id).set(1 if b.available(now) else 0)
    if launcher is not None:
        launcher.update_metrics()
    return generate_latest(metrics.REGISTRY)


class LocalRoutes:
    def __init__(self, pool: BackendPool, launcher: LauncherStatus | None = None):
        self.pool = pool
        self.launcher = launcher  # set by the wiring once launched backends exist

    async def answer(self, ctx: RequestContext, send: Send) -> int:
        """Answer one local route; returns the status sent."""
        kind = ctx.route.kind
        if kind == "health":
            await send_json(send, 200, {"status": "ok"})
            return 200
        if kind == "ready":
            return await self._ready(send)
        if kind == "models":
            return await self._models(ctx, send)
        if kind == "model":
            return await self._model(ctx, send)
        if kind == "metrics":
            if ctx.key is not None and not ctx.key.admin:
                return await _refuse(ctx, send, METRICS_FORBIDDEN)
            body = render_metrics(self.pool, self.launcher)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", METRICS_CONTENT_TYPE)]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return 200
        raise AssertionError(f"no local handler for {kind!r}")

    async def _ready(self, send: Send) -> int:
        now = time.monotonic()
        healthy = sum(1 for b in self.pool if b.available(now))
        status: dict[str, object] = {"status": "ready" if healthy else "not_ready", "healthy_backends": healthy, "backends": len(self.pool)}
        if self.launcher is not None:
            status["failed_instances"] = self.launcher.failed_count()
        code = 200 if healthy else 503
        await send_json(send, code, status)
        return code

    async def _models(self, ctx: RequestContext, send: Send) -> int:
        await send_json(send, 200, {"object": "list", "data": [_model_entry(m) for m in sorted(self._visible(ctx))]})
        return 200

    async def _model(self, ctx: RequestContext, send: Send) -> int:
        model = ctx.scope["path"][len(MODEL_PREFIX) :]
        if model not in self._visible(ctx):  # unknown and not allowed read the same: no probing
            return await _refuse(ctx, send, model_not_found(model))
        await send_json(send, 200, _model_entry(model))
        return 200

    def _visible(self, ctx: RequestContext) -> frozenset[str]:
        allowed = ctx.key.models if ctx.key is not None else None
        models = self.pool.healthy_models()
        return models if allowed is None else models & frozenset(allowed)


async def _refuse(ctx: RequestContext, send: Send, refusal: Refusal) -> int:
    ctx.refusal = refusal.reason
    return await refuse(send, refusal, ctx.style)


def _model_entry(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "lmdeploy-gateway"}
