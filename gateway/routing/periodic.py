"""A round of work repeated every interval (with jitter, so replicas do not probe in lock-step)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable


class Periodic:
    def __init__(self, name: str, round_: Callable[[], Awaitable[None]], interval: Callable[[], float], log: logging.Logger):
        self.name = name
        self._round = round_
        self._interval = interval
        self._log = log
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            try:
                await self._round()
            except Exception:  # keep going whatever one round does
                self._log.exception("%s round failed", self.name)
            await asyncio.sleep(self._interval() * random.uniform(0.9, 1.1))

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
