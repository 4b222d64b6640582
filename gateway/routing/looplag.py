"""How late this process's event loop runs its callbacks: the delay the gateway itself adds.

A response's first byte can be late because the engine queued the request or because the gateway
was too busy to send it or to read the answer in time. The second says nothing about the backend:
a CPU-saturated gateway in front of an instant backend saw first bytes 10x a learnt decode step late
and learnt a batch of 3-5 slots that did not exist (then held requests back for it). ``LoopLag``
measures the first every ``INTERVAL``: how late a timer fires plus how long a callback then waits
for its turn behind the ready ones (what each step of a request waits for), the largest lately.
"""

from __future__ import annotations

import asyncio
import time


class LoopLag:
    INTERVAL = 0.05  # seconds between samples: one callback, ~20 a second, whatever the load
    DECAY = 0.9  # per sample: a burst of lag is remembered for about a second

    __slots__ = ("_loop", "_due", "_max", "_sampled")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._max = 0.0
        self._sampled = False

    def arm(self) -> None:
        """Start sampling on the running loop (cheap once started; nothing outside a loop, as in the
        offline replay, whose virtual time has no lag)."""
        if self._loop is not None and self._loop.is_running():
            # Already sampling this loop (one loop runs in a thread at a time): no lookup, which is
            # a getpid() syscall per call on Python < 3.12.
            return
        loop = asyncio._get_running_loop()
        if loop is not None and loop is not self._loop:
            self._loop = loop
            self._max = 0.0
            self._sampled = False
            self._schedule()

    def _schedule(self) -> None:
        loop = self._loop
        assert loop is not None
        self._due = loop.time() + self.INTERVAL
        loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # re-armed on another loop meanwhile
        late = loop.time() - self._due  # uvloop's clock has 1-ms steps: the turn below is measured finer
        loop.call_soon(self._turn, loop, late if late > 0.0 else 0.0, time.perf_counter())

    def _turn(self, loop: asyncio.AbstractEventLoop, late: float, t0: float) -> None:
        if loop is not self._loop:
            return
        late += time.perf_counter() - t0
        self._sampled = True
        self._max = late if late > self._max * self.DECAY else self._max * self.DECAY
        self._schedule()

    def lag(self) -> float:
        """Seconds the loop ran late lately: the largest recent sample, or the pending timer's delay so
        far when larger (a loop this busy now has not fired it yet). Unknown (infinite) until the first
        sample: a saturated gateway's first responses came late before any sample, and taught slots."""
        loop = self._loop
        if loop is None:
            return 0.0
        if not self._sampled:
            return float("inf")
        overdue = loop.time() - self._due
        return overdue if overdue > self._max else self._max
