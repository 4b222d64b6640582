"""What a config reload may change while the gateway runs, and what needs a restart.

Live: keys and their limits, the media policy, body limits, remote backends, health-check
timing, CORS, the access log and the log level. Everything else (ports, timeouts, the upstream
client, the balancer policy, launch groups, tracing, the admin listener, discovery, the state
dir, the log format) is built once at start-up; a reload that changes any of it is refused as a
whole, naming each field, and nothing is applied.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LIVE = frozenset({"auth", "media", "limits", "backends", "health", "server.access_log", "server.cors", "server.log_level"})
IGNORED = frozenset({"source"})


class ReloadRefused(Exception):
    def __init__(self, fields: list[str]):
        self.fields = fields
        super().__init__(
            "these fields cannot change while the gateway runs; restart it to apply them: " + ", ".join(fields)
        )


def changed_fields(old: Any, new: Any) -> list[str]:
    """Dotted names of the top-level sections (and server's fields) that differ."""
    out = []
    for f in dataclasses.fields(old):
        if f.name in IGNORED:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if f.name == "server":
            out += [f"server.{g.name}" for g in dataclasses.fields(a) if getattr(a, g.name) != getattr(b, g.name)]
        else:
            out.append(f.name)
    return out


def split(old: Any, new: Any) -> tuple[list[str], list[str]]:
    """(live changes, changes that need a restart)."""
    changed = changed_fields(old, new)
    return [c for c in changed if c in LIVE], [c for c in changed if c not in LIVE]
