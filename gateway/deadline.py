"""One loop timer for a deadline that moves often: our server's connections (keep-alive, header,
body, linger) and the upstream client's (first byte, idle between chunks).

Making and cancelling a timer handle costs about 5 µs on uvloop, and a request would otherwise do
it several times. A handle that would fire no later than the new deadline is kept; when it fires
early it re-arms itself for the rest, so a request rarely makes or cancels one.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class MovingDeadline:
    __slots__ = ("loop", "handle", "at", "deadline", "on_expire")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.handle: asyncio.TimerHandle | None = None
        self.at = 0.0  # when ``handle`` fires (<= deadline)
        self.deadline = 0.0
        self.on_expire: Callable[[], None] | None = None

    def arm(self, when: float, callback: Callable[[], None]) -> None:
        """``callback`` at ``when`` (loop time), replacing what was armed."""
        self.deadline = when
        self.on_expire = callback
        if self.handle is not None:
            if self.at <= when:
                return
            self.handle.cancel()
        self.at = when
        self.handle = self.loop.call_at(when, self._expired)

    def disarm(self) -> None:
        self.on_expire = None  # the handle, if any, fires with nothing to do

    def stop(self) -> None:
        """Disarmed, and no handle left to keep its owner alive until it fires."""
        self.on_expire = None
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expired(self) -> None:
        self.handle = None
        callback = self.on_expire
        if callback is None:
            return
        if self.loop.time() < self.deadline:  # moved later since the handle was made: wait the rest
            self.at = self.deadline
            self.handle = self.loop.call_at(self.deadline, self._expired)
            return
        self.on_expire = None
        callback()
