"""Wiring: build every part of the gateway from a validated config, and run its lifecycle.

``Gateway`` owns the long-lived objects (pool, balancer, upstream client, launcher, filters);
``Gateway.asgi()`` is the ASGI app. Start-up starts health checks and launched backends;
shut-down (after uvicorn has drained in-flight requests) stops them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from .config import GatewayConfig
from .filters.auth import ApiKeyAuth
from .filters.body import BodyPolicy
from .filters.cors import CorsPolicy
from .filters.limits import RateLimit
from .filters.media import MediaPolicy
from .filters.paths import PathPolicy
from .listener import Listener
from .local_routes import LocalRoutes
from .routing.policies import make_balancer
from .routing.pool import Backend, BackendPool
from .routing.router import Router
from .routing.queue import Admission, GatewayQueue
from .routing.signals import MetricsScraper, Signals
from .state import make_store
from .state.reload import KeysFileWatcher
from .tracing import Tracing
from .upstream import Upstream, make_client, make_upstream

log = logging.getLogger("gateway")


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.pool = BackendPool(config.health)
        self.balancer = make_balancer(config.balancer.policy, config.balancer)
        self.scraper: MetricsScraper | None = None
        self.paths = PathPolicy()
        self.store = make_store(config)  # keys, limits, usage, shared load (gateway/state)
        self.keys_file = KeysFileWatcher(config.auth, self.store.keys)
        self.auth = ApiKeyAuth(config.auth, self.store.keys)
        self.limits = RateLimit(self.store)
        self.body = BodyPolicy(config.limits)
        self.media = MediaPolicy(config.media)
        self.local = LocalRoutes(self.pool)
        self.cors = CorsPolicy(config.server.cors) if config.server.cors.enabled else None
        self.tracing = Tracing(config.tracing)
        self.upstream: Upstream | None = None
        self.control_client: Any = None
        # The upstream client needs a running loop: startup() gives the router its client.
        self.router = Router(self.pool, self.balancer, None, retries=config.balancer.retries)  # type: ignore[arg-type]
        self.queue: GatewayQueue | None = None
        if config.balancer.queue.enabled and self.balancer.predicts:
            self.queue = self.router.queue = GatewayQueue(Admission(config.balancer.queue, self.balancer, self.pool.eligible, time.monotonic))
        self.pool.on_change(self._pool_changed)
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

    def _pool_changed(self, b: Backend) -> None:
        if self.pool.get(b.id) is not b:  # it left the pool: the policy's state about it goes too
            self.balancer.forget(b.id)
        if self.queue is not None:  # a backend back (or new) can take waiting requests
            self.queue.wake()

    def _observe_signals(self, b: Backend, signals: Signals, changed: bool) -> None:
        self.balancer.observe_signals(b, signals, changed)
        if self.queue is not None:
            self.queue.wake()

    def asgi(self) -> Listener:
        if self._listener is None:
            self._listener = Listener(
                paths=self.paths,
                auth=self.auth,
                limits=self.limits,
                body=self.body,
                media=self.media,
                local=self.local,
                router=self.router,
                max_body=self.config.limits.max_body_bytes,
                access_log=self.config.server.access_log,
                startup=self.startup,
                shutdown=self.shutdown,
                cors=self.cors,
                tracer=self.tracing,
            )
        return self._listener

    async def startup(self) -> None:
        if self.config.auth.disabled:
            log.warning("AUTHENTICATION IS DISABLED (auth.disabled: true): anyone who can reach this port can use every backend")
        await self.store.start()
        self.keys_file.start()
        up = self.config.upstream
        self.upstream = make_upstream(up.transport, self.config.timeouts, up.max_connections, up)
        self.router.upstream = self.upstream
        self.control_client = make_client(self.config.timeouts)  # health checks and metrics scraping
        self.pool.start(self.control_client)
        interval = self.config.balancer.scrape_interval
        if interval > 0 and self.balancer.reads_signals:
            # Backend gauges (queue, running, KV use) for the policies that read them.
            self.scraper = MetricsScraper(lambda: self.pool, self._observe_signals, interval=interval, client=self.control_client)
            self.scraper.start()
        if self.config.launch:
            from .launcher import Launcher  # imported lazily: a gateway with only remote backends needs none of it

            log_dir = os.environ.get("LMDEPLOY_GATEWAY_LOG_DIR") or Path(self.config.state_dir) / "logs"
            self.launcher = Launcher(self.config.launch, self.pool, log_dir=log_dir)
            self.local.launcher = self.launcher
            await self.launcher.start()
        await self.pool.check_all()
        log.info("gateway started: %d backend(s) configured, %d healthy", len(self.pool), sum(1 for b in self.pool if b.healthy))

    async def shutdown(self) -> None:
        if self.launcher is not None:
            await self.launcher.stop(grace=10.0)
        if self.scraper is not None:
            await self.scraper.stop()
        await self.pool.stop()
        await self.keys_file.stop()
        await self.store.close()
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.control_client is not None:
            await self.control_client.aclose()
        self.tracing.shutdown()
