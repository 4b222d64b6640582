"""Wiring: build every part of the gateway from a validated config, and run its lifecycle.

``Gateway`` owns the long-lived objects (pool, balancer, upstream client, launcher, filters);
``Gateway.asgi()`` is the ASGI app. Start-up starts health checks and launched backends;
shut-down (after uvicorn has drained in-flight requests) stops them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import generate_latest

from . import metrics
from .config import GatewayConfig
from .errors import Refusal
from .filters import RequestContext
from .filters.auth import ApiKeyAuth
from .filters.body import BodyPolicy
from .filters.limits import RateLimit
from .filters.media import MediaPolicy
from .filters.paths import PathPolicy
from .listener import Listener, Send, send_json
from .routing.balancer import make_balancer
from .routing.pool import Backend, BackendPool
from .routing.router import Router
from .routing.signals import MetricsScraper
from .upstream import Upstream, make_client, make_upstream

log = logging.getLogger("gateway")

METRICS_FORBIDDEN = Refusal(403, "This API key may not read the gateway's metrics (it needs `admin: true`).", "not_admin", code="permission_denied")


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.pool = BackendPool(config.health)
        self.balancer = make_balancer(config.balancer.policy, config.balancer)
        self.scraper: MetricsScraper | None = None
        self.paths = PathPolicy()
        self.auth = ApiKeyAuth(config.auth)
        self.limits = RateLimit(config.auth)
        self.body = BodyPolicy(config.limits)
        self.media = MediaPolicy(config.media)
        self.upstream: Upstream | None = None
        self.control_client: Any = None
        # The upstream client needs a running loop: startup() gives the router its client.
        self.router = Router(self.pool, self.balancer, None, retries=config.balancer.retries)  # type: ignore[arg-type]
        self.launcher: Any = None
        for i, b in enumerate(config.backends):
            self.pool.add(
                Backend(
                    id=b.name or f"remote-{i}",
                    url=b.url,
                    api_key=b.api_key,
                    models=frozenset(b.models or ()),
                    static_models=b.models is not None,
                    origin="static",
                )
            )
        self._listener: Listener | None = None

    def asgi(self) -> Listener:
        if self._listener is None:
            self._listener = Listener(self)
        return self._listener

    async def startup(self) -> None:
        if self.config.auth.disabled:
            log.warning("AUTHENTICATION IS DISABLED (auth.disabled: true): anyone who can reach this port can use every backend")
        up = self.config.upstream
        self.upstream = make_upstream(up.transport, self.config.timeouts, up.max_connections, up)
        self.router.upstream = self.upstream
        self.control_client = make_client(self.config.timeouts)  # health checks and metrics scraping
        self.pool.start(self.control_client)
        interval = self.config.balancer.scrape_interval
        if interval > 0 and hasattr(self.balancer, "observe_signals"):
            # Backend gauges (queue, running, KV use) for the policies that read them.
            self.scraper = MetricsScraper(lambda: self.pool, self.balancer.observe_signals, interval=interval, client=self.control_client)
            self.scraper.start()
        if self.config.launch:
            from .launcher import Launcher  # imported lazily: a gateway with only remote backends needs none of it

            self.launcher = Launcher(self.config.launch, self.pool)
            await self.launcher.start()
        await self.pool.check_all()
        log.info("gateway started: %d backend(s) configured, %d healthy", len(self.pool), sum(1 for b in self.pool if b.healthy))

    async def shutdown(self) -> None:
        if self.launcher is not None:
            await self.launcher.stop(grace=10.0)
        if self.scraper is not None:
            await self.scraper.stop()
        await self.pool.stop()
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.control_client is not None:
            await self.control_client.aclose()

    # -- routes answered by the gateway itself ----------------------------------------------------
    async def answer_local(self, ctx: RequestContext, send: Send) -> int:
        """Routes the gateway answers itself; returns the status sent."""
        kind = ctx.route.kind
        if kind == "health":
            await send_json(send, 200, {"status": "ok"})
            return 200
        elif kind == "ready":
            healthy = sum(1 for b in self.pool if b.available(_now()))
            status = {"status": "ready" if healthy else "not_ready", "healthy_backends": healthy, "backends": len(self.pool)}
            if self.launcher is not None:
                status["failed_instances"] = self.launcher.failed_count()
            await send_json(send, 200 if healthy else 503, status)
            return 200 if healthy else 503
        elif kind == "models":
            models = sorted(m for m in self.pool.healthy_models() if ctx.key is None or ctx.key.models is None or m in ctx.key.models)
            await send_json(
                send,
                200,
                {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "lmdeploy-gateway"} for m in models]},
            )
            return 200
        elif kind == "metrics":
            if ctx.key is not None and not ctx.key.admin:
                return await self.asgi()._refuse(send, METRICS_FORBIDDEN, "openai")
            for b in self.pool:
                metrics.IN_FLIGHT.labels(backend=b.id).set(b.in_flight)
                metrics.BACKEND_HEALTHY.labels(backend=b.id).set(1 if b.available(_now()) else 0)
            if self.launcher is not None and hasattr(self.launcher, "update_metrics"):
                self.launcher.update_metrics()
            body = generate_latest(metrics.REGISTRY)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return 200
        raise AssertionError(f"no local handler for {kind!r}")


_now = time.monotonic
