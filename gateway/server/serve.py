"""Run an ASGI app on our HTTP/1.1 server: bind (or take pre-bound sockets), lifespan, drain.

``run()`` is the process entry point (``gateway serve``). ``Server`` is what it drives, also
used by the tests' in-process harness: ``await server.run()`` until ``request_stop()``.
On SIGTERM/SIGINT: stop accepting, close idle connections, let in-flight requests finish for
up to ``drain`` seconds, abort what is left, then run the app's lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import socket
import sys
from typing import Any

from ..config import ServerConfig
from .connections import Connections
from .limits import ServerLimits
from .protocol import HttpConnection

log = logging.getLogger("gateway.server")

BACKLOG = 2048
# The collector's young generation is scanned every GC_GEN0 allocations. A request allocates a few
# thousand short-lived objects, almost none in cycles; at CPython's default (700) the young scans
# cost several percent of a request. The count still bounds the garbage held between scans.
GC_THRESHOLDS = (50_000, 20, 100)


class PortBusy(Exception):
    pass


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket, or PortBusy with a message that says what to do.

    ``reuse_port``: several worker processes each bind their own socket to the same port
    (SO_REUSEPORT) and the kernel spreads new connections over them.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortBusy(f"cannot listen on {host}:{port}: the port is already in use; stop what holds it or choose another with --port or server.port") from None
        raise PortBusy(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class _Lifespan:
    """The ASGI lifespan protocol, from the server's side."""

    def __init__(self, app: Any):
        self.app = app
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.started: asyncio.Future[str | None] | None = None
        self.stopped: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    async def startup(self) -> str | None:
        """None once started; the failure's message otherwise."""
        loop = asyncio.get_running_loop()
        self.started, self.stopped = loop.create_future(), loop.create_future()
        self.task = loop.create_task(self._run())
        await self.inbox.put({"type": "lifespan.startup"})
        return await self.started

    async def shutdown(self, timeout: float) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(asyncio.shield(self.stopped), timeout)  # type: ignore[arg-type]
        except asyncio.TimeoutError:
            log.warning("lifespan shutdown did not finish within %.0f s", timeout)
            self.task.cancel()

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self.app(scope, self.inbox.get, self._send)
        except BaseException as exc:  # noqa: BLE001 - reported through the futures
            self._settle(f"lifespan failed: {exc.__class__.__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            log.exception("lifespan failed")
        finally:
            self._settle("the app ended its lifespan before start-up completed")

    def _settle(self, failure: str) -> None:
        if self.started is not None and not self.started.done():
            self.started.set_result(failure)
        if self.stopped is not None and not self.stopped.done():
            self.stopped.set_result(None)

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self.started.set_result(None)  # type: ignore[union-attr]
        elif kind == "lifespan.startup.failed":
            self.started.set_result(message.get("message") or "start-up failed")  # type: ignore[union-attr]
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if not self.stopped.done():  # type: ignore[union-attr]
                self.stopped.set_result(None)  # type: ignore[union-attr]


class Server:
    def __init__(self, app: Any, cfg: ServerConfig, *, drain: float, sockets: list[socket.socket], gc_tuning: bool = False):
        self.app = app
        self.gc_tuning = gc_tuning  # the process is ours alone (``run``): tune its collector after start-up
        self.limits = ServerLimits.from_config(cfg, drain)
        self.sockets = sockets
        self.started = False
        self.connections: Connections | None = None
        self._stop: asyncio.Event | None = None
        self._force: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stop_signal: int | None = None  # the first signal that stopped it (SIGINT: exit 130)

    def _on_signal(self, signum: int) -> None:
        assert self._stop is not None and self._force is not None
        if self._stop.is_set():  # an impatient second signal: stop draining, shut down now
            log.warning("second signal: in-flight requests are cut off; stopping backends")
            self._force.set()
            return
        self.stop_signal = signum
        self._stop.set()

    def request_stop(self) -> None:
        """Begin the graceful shutdown; safe from any thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self, install_signals: bool = True) -> int:
        loop = self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        lifespan = _Lifespan(self.app)
        failure = await lifespan.startup()
        if failure is not None:
            log.error("start-up failed: %s", failure)
            return 1
        if self.gc_tuning:
            tune_gc()
        conns = self.connections = Connections(self.app, self.limits, loop)
        servers = [await loop.create_server(lambda: HttpConnection(conns), sock=s, backlog=BACKLOG) for s in self.sockets]
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        for s in self.sockets:
            host, port = s.getsockname()[:2]
            log.info("listening on http://%s:%d (at most %d connections)", host, port, self.limits.max_connections)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            log.info("shutting down: draining in-flight requests for up to %.0f s", self.limits.drain_timeout)
            for srv in servers:
                srv.close()
            conns.shutdown()
            drained = loop.create_task(conns.empty.wait())
            forced = loop.create_task(self._force.wait())
            try:
                await asyncio.wait({drained, forced}, timeout=self.limits.drain_timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                forced.cancel()
                drained.cancel()
            if conns.open:
                log.warning("%d connection(s) still open after the drain: aborted", len(conns.open))
                conns.abort_all()
            for srv in servers:
                await srv.wait_closed()
            await lifespan.shutdown(timeout=60.0)
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
        return 130 if self.stop_signal == signal.SIGINT else 0  # Ctrl-C: the shell's convention


class Serving:
    """A server started in a running loop by ``start()``: no lifespan, no signal handlers."""

    def __init__(self, servers: list[asyncio.base_events.Server], connections: Connections, sockets: list[socket.socket]):
        self.servers, self.connections, self.sockets = servers, connections, sockets
        self.port: int = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish up to the drain timeout, close the rest."""
        for srv in self.servers:
            srv.close()
        self.connections.shutdown()
        try:
            await asyncio.wait_for(self.connections.empty.wait(), self.connections.limits.drain_timeout)
        except asyncio.TimeoutError:
            self.connections.abort_all()
        for srv in self.servers:
            await srv.wait_closed()


async def start(app: Any, cfg: ServerConfig, *, drain: float, sockets: list[socket.socket]) -> Serving:
    """Serve ``app`` on ``sockets`` in this loop with the same bounds, e.g. a second (admin) port."""
    loop = asyncio.get_running_loop()
    conns = Connections(app, ServerLimits.from_config(cfg, drain), loop)
    servers = [await loop.create_server(lambda: HttpConnection(conns), sock=s, backlog=BACKLOG) for s in sockets]
    return Serving(servers, conns, sockets)


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; stdlib asyncio works too
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def tune_gc() -> None:
    """For a serving process, once start-up is done: what start-up allocated (config, modules, the
    app) is moved out of the collector's reach (``gc.freeze``), so the full collections the request
    garbage triggers no longer walk it, and the young generation is scanned less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(app: Any, cfg: ServerConfig, *, drain: float, host: str, port: int, sockets: list[socket.socket] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the process exit status. Pass ``sockets`` to use pre-bound ones."""
    if sockets is None:
        try:
            sockets = [bind(host, port)]
        except PortBusy as exc:
            print(f"gateway: {exc}", file=sys.stderr)
            return 1
    server = Server(app, cfg, drain=drain, sockets=sockets, gc_tuning=True)
    loop = new_loop()
    try:
        return loop.run_until_complete(server.run())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
