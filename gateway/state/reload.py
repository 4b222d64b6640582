"""Keys from the config's keys file, reloaded on SIGHUP and when the file changes.

The file is polled once a second (a ``stat``, nothing more unless it changed). A file that no
longer validates is logged and ignored: the keys already loaded keep working.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from ..config import AuthConfig, ConfigError
from ..config.core import read_keys_file
from . import stats
from .keys import KeyCache

log = logging.getLogger("gateway.state.keys")

POLL_EVERY = 1.0


class KeysFileWatcher:
    def __init__(self, auth: AuthConfig, cache: KeyCache) -> None:
        self.path = auth.keys_file
        self.inline = auth.inline_keys
        self.cache = cache
        self._stamp = self._stat()
        self._task: asyncio.Task[None] | None = None
        self._signal = False

    def _stat(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self, source: str = "file") -> bool:
        if self.path is None:
            return False
        self._stamp = self._stat()
        try:
            keys = read_keys_file(self.path)
        except ConfigError as exc:
            stats.KEY_RELOADS.labels(source=source, result="invalid").inc()
            log.error("keys file %s not reloaded (the loaded keys stay in force): %s", self.path, "; ".join(exc.problems))
            return False
        self.cache.set_config_keys((*self.inline, *keys))
        stats.KEY_RELOADS.labels(source=source, result="ok").inc()
        log.info("keys file %s reloaded: %d key(s)", self.path, len(keys))
        return True

    def start(self) -> None:
        if self.path is None:
            return
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            try:
                loop.add_signal_handler(signal.SIGHUP, lambda: self.reload("sighup"))
                self._signal = True
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        self._task = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_EVERY)
            if self._stat() != self._stamp:
                self.reload("file")

    async def stop(self) -> None:
        if self._signal:
            try:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            except Exception:
                pass
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
