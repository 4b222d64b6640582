"""The bounds one server process enforces, resolved once from ``server:`` and the process limits."""

from __future__ import annotations

import resource
from dataclasses import dataclass

from ..config import ServerConfig

# Files the process needs besides connections: logs, the launcher's pipes, redis, health probes.
RESERVED_FDS = 64


@dataclass(frozen=True)
class ServerLimits:
    max_request_line: int
    max_head: int  # request line + headers
    max_headers: int
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int
    linger_timeout: float
    linger_bytes: int
    drain_timeout: float

    @classmethod
    def from_config(cls, cfg: ServerConfig, drain: float) -> "ServerLimits":
        return cls(
            max_request_line=cfg.max_request_line_bytes,
            max_head=cfg.max_header_bytes,
            max_headers=cfg.max_headers,
            header_timeout=cfg.header_timeout,
            body_timeout=cfg.body_timeout,
            keepalive_timeout=cfg.keepalive_timeout,
            max_connections=cfg.max_connections or connection_cap(),
            linger_timeout=cfg.linger_timeout,
            linger_bytes=cfg.linger_bytes,
            drain_timeout=drain,
        )


def connection_cap(soft_limit: int | None = None) -> int:
    """Client connections that fit under the open-files limit with headroom.

    Each client connection may hold one upstream connection while it is forwarded, so clients get
    half of what is left after the reserve. Past the cap new connections are shed (idle ones
    first), so accept() never fails with EMFILE and the listening socket never stalls.
    """
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit == resource.RLIM_INFINITY:
            soft_limit = 1 << 20
    return max(8, (soft_limit - RESERVED_FDS) // 2)
