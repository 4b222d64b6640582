"""Start-up progress: one refreshed line on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Callable, Sequence, TextIO

log = logging.getLogger("gateway.launcher")

SETTLED = frozenset({"healthy", "failed", "crash_loop", "stopped"})


def summary(rows: Sequence[tuple[str, str, float]]) -> str:
    """``chat#0 loading 12s | chat#1 healthy 8s`` from (id, state, elapsed) rows."""
    return " | ".join(f"{i} {state} {elapsed:.0f}s" for i, state, elapsed in rows)


async def report_progress(
    rows: Callable[[], Sequence[tuple[str, str, float]]],
    stream: TextIO | None = None,
    *,
    tty: bool | None = None,
    interval: float = 0.5,
    log_every: float = 30.0,
) -> None:
    """Show progress until every instance has settled (healthy or given up), then one final line."""
    stream = sys.stderr if stream is None else stream
    if tty is None:
        tty = bool(getattr(stream, "isatty", lambda: False)())
    last_log = time.monotonic()
    try:
        while True:
            current = rows()
            settled = all(state in SETTLED for _, state, _ in current)
            if tty:
                stream.write("\r\x1b[K[launcher] " + summary(current) + ("\n" if settled else ""))
                stream.flush()
            elif settled or time.monotonic() - last_log >= log_every:
                log.info("instances: %s", summary(current))
                last_log = time.monotonic()
            if settled:
                return
            await asyncio.sleep(interval)
    except asyncio.CancelledError:
        if tty:
            stream.write("\n")
            stream.flush()
        raise
