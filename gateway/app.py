"""Wiring: build every part of the gateway from a validated config, and run its lifecycle.

``Gateway`` owns the long-lived objects (pool, balancer, upstream client, launcher, filters);
``Gateway.asgi()`` is the ASGI app. Start-up starts health checks and launched backends;
shut-down (after the server has drained in-flight requests) stops them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
import time
from typing import Any

from .admin import AdminApp, LiveStats, ReloadRefused, RunningServer, split, start_server
from .config import ConfigError, GatewayConfig, load_config
from .filters.auth import ApiKeyAuth
from .filters.body import BodyPolicy
from .filters.cors import CorsPolicy
from .filters.limits import RateLimit
from .filters.media import MediaPolicy
from .filters.paths import PathPolicy
from .listener import Listener
from .local_routes import LocalRoutes, render_metrics
from .routing.policies import make_balancer
from .routing.discovery import DnsDiscovery, Resolver, system_resolver
from .routing.pool import Backend, BackendPool
from .routes import RouteAccess
from .routing.disagg import PDDispatcher
from .routing.router import Router
from .routing.queue import Admission, GatewayQueue
from .routing.signals import MetricsScraper, Signals
from .state import make_store
from .state.reload import KeysFileWatcher
from .tracing import Tracing
from .upstream import NativeUpstream, Upstream, make_client

log = logging.getLogger("gateway")


class Gateway:
    def __init__(self, config: GatewayConfig, *, resolver: Resolver | None = None):
        self.config = config
        self.pool = BackendPool(config.health)
        self.balancer = make_balancer(config.balancer.policy, config.balancer)
        self.scraper: MetricsScraper | None = None
        self.paths = PathPolicy()
        self.store = make_store(config)  # keys, limits, usage, shared load (gateway/state)
        self.keys_file = KeysFileWatcher(config.auth, self.store.keys)
        self.auth = ApiKeyAuth(config.auth, self.store.keys)
        self.limits = RateLimit(self.store)
        self.cluster: Any = None
        self.follow_backends = False  # a worker that learns launched backends from the launching one (gateway/workers.py)
        self.internal_key: str | None = None  # the launched api_servers' key, from the --workers parent (never from Redis)
        self.launch_cpus: tuple[int, ...] | None = None  # the api_servers' CPUs when this worker is pinned (--pin-workers)
        self.body = BodyPolicy(config.limits)
        self.media = MediaPolicy(config.media)
        self.local = LocalRoutes(self.pool)
        self.cors = CorsPolicy(config.server.cors) if config.server.cors.enabled else None
        self.tracing = Tracing(config.tracing)
        self.upstream: Upstream | None = None
        self.control_client: Any = None
        # The upstream client needs a running loop: startup() gives the router its client.
        self.router = Router(self.pool, self.balancer, None, retries=config.balancer.retries)  # type: ignore[arg-type]
        self.router.access = RouteAccess({name: m.routes for name, m in config.models.items()})
        self.disagg: PDDispatcher | None = None
        if any(m.distserve for m in config.models.values()):
            self.disagg = self.router.disagg = PDDispatcher(self.pool, config.models, retries=config.balancer.retries, slots=config.balancer.slots)
        self.queue: GatewayQueue | None = None
        if config.balancer.queue.enabled and self.balancer.predicts:
            self.queue = self.router.queue = GatewayQueue(Admission(config.balancer.queue, self.balancer, self.pool.eligible, time.monotonic))
        if self.disagg is not None and config.balancer.queue.enabled:  # PD models: the picker predicts, whatever the policy
            self.disagg.enable_queue(config.balancer.queue, time.monotonic)
        self.pool.on_change(self._pool_changed)
        self.launcher: Any = None
        for b in static_backends(config):
            self.pool.add(b)
        self._listener: Listener | None = None
        self.discovery = [DnsDiscovery(d, self.pool, resolver=resolver or system_resolver, on_removed=self._forget) for d in config.discover]
        self.config_path: str | None = config.source if config.source != "<memory>" else None  # what a reload re-reads
        self.stats: LiveStats | None = None
        self.admin: AdminApp | None = None
        self.admin_server: RunningServer | None = None
        if config.admin.enabled:
            self.stats = LiveStats()
            self.admin = AdminApp(
                key_hash=config.admin.key_hash or "",
                pool=self.pool,
                stats=self.stats,
                metrics=lambda: render_metrics(self.pool, self.launcher),
                reload=self.reload,
                launcher=lambda: self.launcher,
                usage=self.store.usage,
                key_names=lambda: {k.hash: k.name for k in self.store.keys.all()},
                balancer=self.learnt,
            )

    def _pool_changed(self, b: Backend) -> None:
        if self.pool.get(b.id) is not b:  # it left the pool: the policy's state about it goes too
            self.balancer.forget(b.id)
        self._wake_queues()  # a backend back (or new) can take waiting requests

    def _observe_signals(self, b: Backend, signals: Signals, changed: bool) -> None:
        self.balancer.observe_signals(b, signals, changed)
        if b.role == "decode" and self.disagg is not None:
            self.disagg.picker.observe_signals(b, signals, changed)  # its batch slots, for PD admission
        self._wake_queues()

    def learnt(self) -> dict[str, Any]:
        """What the balancer and the gateway queue have learnt, and each backend's last /metrics poll."""
        out = self.balancer.learnt(list(self.pool))
        out["queue"] = self.queue.admission.learnt() if self.queue is not None else None
        out["signals"] = {i: dataclasses.asdict(sig) for i, sig in self.scraper.signals.items()} if self.scraper is not None else {}
        return out

    def _wake_queues(self) -> None:
        """Capacity may have freed somewhere: the queues (hybrid and prefill/decode models) bind who can start."""
        if self.queue is not None:
            self.queue.wake()
        if self.disagg is not None and self.disagg.queue is not None:
            self.disagg.queue.wake()

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
                max_upload_per_key=self.config.limits.max_upload_bytes_per_key,
                access_log=self.config.server.access_log,
                startup=self.startup,
                shutdown=self.shutdown,
                cors=self.cors,
                tracer=self.tracing,
                observe=self.stats.observe if self.stats is not None else None,
            )
        return self._listener

    async def startup(self) -> None:
        if self.config.auth.disabled:
            log.warning("AUTHENTICATION IS DISABLED (auth.disabled: true): anyone who can reach this port can use every backend")
        if self.store.shared:  # load, ejections and launched backends shared with the other replicas
            from .state.cluster import Cluster

            self.cluster = Cluster(self.store, self.pool, Backend, publish_backends=bool(self.config.launch),  # type: ignore[arg-type]
                                   follow_backends=self.follow_backends, backend_key=self.internal_key,
                                   freed=self._wake_queues, balancer=self.balancer)
            self.cluster.start()  # before the store starts: it subscribes to the cluster's channel too
        await self.store.start()
        self.keys_file.start()
        self.upstream = NativeUpstream(self.config.timeouts, self.config.upstream)
        self.router.upstream = self.upstream
        if self.disagg is not None:
            self.disagg.upstream = self.upstream
        self.control_client = make_client(self.config.timeouts)  # health checks and metrics scraping
        self.pool.start(self.control_client)
        if self.disagg is not None:
            self.disagg.client = self.control_client
        if self.admin is not None:
            admin = self.config.admin
            self.admin_server = await start_server(self.admin, admin.host, admin.port, self.config.server, drain=min(self.config.timeouts.drain, 5.0))
            log.info("admin listener on http://%s:%d (status page: /status)", admin.host, self.admin_server.port)
        interval = self.config.balancer.scrape_interval
        if interval > 0 and (self.balancer.reads_signals or self.disagg is not None):
            # Backend gauges (queue, running, KV use) for the policies that read them and the PD
            # picker (decode instances' batch slots).
            self.scraper = MetricsScraper(lambda: self.pool, self._observe_signals, interval=interval, client=self.control_client)
            self.scraper.start()
        for d in self.discovery:
            await d.refresh()
            d.start()
        if self.config.launch:
            from .launcher import Launcher  # imported lazily: a gateway with only remote backends needs none of it

            log_dir = os.environ.get("LMDEPLOY_GATEWAY_LOG_DIR") or Path(self.config.state_dir) / "logs"
            self.launcher = Launcher(self.config.launch, self.pool, log_dir=log_dir, backend_key=self.internal_key, cpus=self.launch_cpus)
            self.local.launcher = self.launcher
            await self.launcher.start()
        await self.pool.check_all()
        log.info("gateway started: %d backend(s) configured, %d healthy", len(self.pool), sum(1 for b in self.pool if b.healthy))

    async def shutdown(self) -> None:
        if self.disagg is not None:
            self.disagg.close()
        if self.admin_server is not None:
            await self.admin_server.stop()
        if self.launcher is not None:
            await self.launcher.stop(grace=10.0)
        for d in self.discovery:
            await d.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        await self.pool.stop()
        await self.keys_file.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        await self.store.close()
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.control_client is not None:
            await self.control_client.aclose()
        self.tracing.shutdown()

    # -- live changes (the admin listener's reload) -------------------------------------------------
    async def reload(self) -> list[str]:
        """Re-read the config file and apply what may change live; returns the fields applied.

        Raises ConfigError (nothing applied) or ReloadRefused naming the fields that need a restart.
        """
        if self.config_path is None:
            raise ConfigError(["this gateway was not started from a config file; there is nothing to re-read"])
        new = load_config(self.config_path)
        live, fixed = split(self.config, new)
        if fixed:
            raise ReloadRefused(fixed)
        if new.auth.disabled != self.config.auth.disabled or new.auth.keys_file != self.config.auth.keys_file:
            raise ReloadRefused([f for f in ("auth.disabled", "auth.keys_file") if getattr(new.auth, f[5:]) != getattr(self.config.auth, f[5:])])
        listener = self.asgi()
        if "auth" in live:
            self.store.keys.set_config_keys(new.auth.keys)  # the same cache the keys-file watcher feeds
            self.keys_file.inline = new.auth.inline_keys
        if "auth" in live or "media" in live:
            listener.media = self.media = MediaPolicy(new.media)
        if "limits" in live:
            listener.body = self.body = BodyPolicy(new.limits)
            listener.max_body = new.limits.max_body_bytes
        if "health" in live:
            self.pool.health = new.health
        if "server.cors" in live:
            listener.cors = self.cors = CorsPolicy(new.server.cors) if new.server.cors.enabled else None
        if "server.access_log" in live:
            listener.access_log = new.server.access_log
        if "server.log_level" in live:
            logging.getLogger().setLevel(new.server.log_level.upper())
        if "backends" in live:
            self._replace_static_backends(new)
        self.config = new
        log.info("config reloaded from %s: %s", self.config_path, ", ".join(live) or "nothing changed",
                 extra={"fields": {"event": "config_reloaded", "applied": live}})
        return live

    def _forget(self, backend_id: str) -> None:
        if self.stats is not None:
            self.stats.forget(backend_id)

    def _replace_static_backends(self, new: GatewayConfig) -> None:
        wanted = {b.id: b for b in static_backends(new)}
        for b in self.pool:
            if b.origin != "static":
                continue
            w = wanted.get(b.id)
            if w is None or (w.url, w.api_key, w.models, w.static_models) != (b.url, b.api_key, b.models, b.static_models):
                self.pool.remove(b.id)
                if self.stats is not None:
                    self.stats.forget(b.id)
        for backend_id, b in wanted.items():
            if self.pool.get(backend_id) is None:
                self.pool.add(b)


def static_backends(config: GatewayConfig) -> list[Backend]:
    return [
        Backend(
            id=b.name or f"remote-{i}",
            url=b.url,
            api_key=b.api_key,
            models=frozenset(b.models or ()),
            static_models=b.models is not None,
            origin="static",
            role=b.role,
        )
        for i, b in enumerate(config.backends)
    ]
