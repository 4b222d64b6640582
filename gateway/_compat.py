"""Python 3.10 stand-in for ``asyncio.timeout`` (3.11+): a reschedulable deadline on the current task."""

from __future__ import annotations

import asyncio


class timeout:  # noqa: N801 - mirrors asyncio.timeout
    def __init__(self, delay: float | None):
        self._delay = delay
        self._handle: asyncio.TimerHandle | None = None
        self._expired = False

    async def __aenter__(self) -> "timeout":
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        if self._delay is not None:
            self.reschedule(self._loop.time() + self._delay)
        return self

    def _fire(self) -> None:
        self._expired = True
        assert self._task is not None
        self._task.cancel()

    def reschedule(self, when: float | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None if when is None else self._loop.call_at(when, self._fire)

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if self._handle is not None:
            self._handle.cancel()
        if exc_type is asyncio.CancelledError and self._expired:
            raise TimeoutError from None
        return False
