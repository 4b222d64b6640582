"""The state layer: keys, per-key limits, usage and shared load.

``make_store(config)`` picks the implementation: ``MemoryStore`` (default: one process) or
``RedisStore`` (``state: {redis_url: ...}``: every replica and worker shares it).
"""

from __future__ import annotations

from ..config import GatewayConfig
from .base import StateStore, UsageRow
from .limits import Admission

__all__ = ["Admission", "StateStore", "UsageRow", "make_store"]


def make_store(config: GatewayConfig) -> StateStore:
    if config.state.redis_url:
        from .redis import RedisStore

        return RedisStore(config)
    from .memory import MemoryStore

    return MemoryStore(config)
