"""The open connections of one server: the cap, shedding, and the drain on shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .answers import error_response
from .limits import ServerLimits

HttpConnection = Any  # protocol.HttpConnection; not imported, so neither module imports the other

log = logging.getLogger("gateway.server")

SHED_LOG_EVERY = 10.0  # seconds between two log lines about shed connections
_SHED = error_response(503, "The gateway is at its connection limit; retry shortly.", "too_many_connections", b"retry-after: 1\r\n")


class Connections:
    def __init__(self, app: Any, limits: ServerLimits, loop: asyncio.AbstractEventLoop):
        self.app = app
        self.limits = limits
        self.loop = loop
        self.open: set["HttpConnection"] = set()
        self.idle_since: dict["HttpConnection", None] = {}  # insertion order: longest idle first
        self.shed = 0  # connections refused at the cap (503), ever
        self.evicted = 0  # idle connections closed to make room, ever
        self._reported = (0, 0)
        self._last_log = 0.0
        self.draining = False
        self.empty = asyncio.Event()

    def admit(self, conn: "HttpConnection") -> bool:
        """Take a new connection, or shed it: at the cap an idle one makes room, else a 503 and close."""
        if len(self.open) >= self.limits.max_connections:
            if self.idle_since:
                oldest = next(iter(self.idle_since))
                self.forget(oldest)
                oldest._close()
                self.evicted += 1
            else:
                self.shed += 1
                transport = conn.transport
                assert transport is not None
                transport.write(_SHED)
                transport.close()
                self._report()
                return False
            self._report()
        self.open.add(conn)
        self.idle_since[conn] = None
        self.empty.clear()
        return True

    def forget(self, conn: "HttpConnection") -> None:
        self.open.discard(conn)
        self.idle_since.pop(conn, None)
        if not self.open:
            self.empty.set()

    def busy(self, conn: "HttpConnection") -> None:
        self.idle_since.pop(conn, None)

    def idle(self, conn: "HttpConnection") -> None:
        if conn in self.open:
            self.idle_since.pop(conn, None)
            self.idle_since[conn] = None

    def _report(self) -> None:
        now = time.monotonic()
        if now - self._last_log < SHED_LOG_EVERY:
            return
        shed, evicted = self.shed - self._reported[0], self.evicted - self._reported[1]
        self._reported, self._last_log = (self.shed, self.evicted), now
        log.warning(
            "connection limit of %d reached (server.max_connections): %d new connection(s) refused with 503, %d idle one(s) closed to make room",
            self.limits.max_connections, shed, evicted,
        )

    def shutdown(self) -> None:
        """Stop taking requests: idle connections close now, busy ones after their response."""
        self.draining = True
        for conn in list(self.open):
            conn.shutdown()
        if not self.open:
            self.empty.set()

    def abort_all(self) -> None:
        for conn in list(self.open):
            for cycle in (conn.cycle, *conn.pending):
                if cycle is not None and cycle.task is not None:
                    cycle.task.cancel()
            conn.abort()
