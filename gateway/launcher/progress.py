"""Start-up progress: every instance's state and elapsed time until all have settled.

On a terminal a line every couple of seconds; in a log, a line every half minute. Always whole
lines: the gateway's own log lines interleave with them, so a redrawn line would be torn.
"""

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
    tty_every: float = 2.0,
    log_every: float = 30.0,
) -> None:
    """Report until every instance has settled (healthy or given up), then once more."""
    stream = sys.stderr if stream is None else stream
    if tty is None:
        tty = bool(getattr(stream, "isatty", lambda: False)())
    every = tty_every if tty else log_every
    last_time, last_states = time.monotonic(), None
    while True:
        current = rows()
        states = [state for _, state, _ in current]
        settled = all(state in SETTLED for state in states)
        if states != last_states or settled or time.monotonic() - last_time >= every:
            if tty:
                stream.write(f"[launcher] {summary(current)}\n")
                stream.flush()
            elif settled or last_states is None or time.monotonic() - last_time >= every:
                log.info("instances: %s", summary(current))  # state changes are logged on their own
            last_time, last_states = time.monotonic(), states
        if settled:
            return
        await asyncio.sleep(interval)
