"""Everything one simulator instance owns, built once from its ``SimConfig``.

Nothing here is module-global, so tests may run several simulators in one process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

from .config import SimConfig
from .engine import Engine, EngineLimits, Timing
from .faults import Faults, Health
from .metrics import SimMetrics
from .recorder import RequestRecorder


class SimState:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.models = config.models
        self.timing = Timing(
            ttft=config.ttft,
            tpot=config.tpot,
            speed=config.speed,
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            batch_slowdown=config.batch_slowdown,
            cold_steps=config.cold_steps,
            cold_factor=config.cold_factor,
        )
        self.metrics = SimMetrics(config.model, config.max_batch_size)
        self.engine = Engine(
            self.timing,
            EngineLimits(config.max_batch_size, config.kv_capacity_tokens, config.block_tokens),
            self.metrics,
        )
        self.recorder = RequestRecorder(config.record_limit)
        self.faults = Faults()
        self.health = Health()
        self.sleep_level = 0
        self.started_at = time.time()
        # Key digests, compared in constant time like lmdeploy's AuthenticationMiddleware.
        self._key_digests = tuple(hashlib.sha256(k.encode()).digest() for k in config.api_keys)

    @property
    def auth_enabled(self) -> bool:
        return bool(self._key_digests)

    def key_matches(self, presented: str) -> bool:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        match = False
        for known in self._key_digests:
            match |= hmac.compare_digest(digest, known)  # no early exit: every key is compared
        return match

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def health_snapshot(self) -> tuple[int, dict[str, str]]:
        return self.health.snapshot(self.now())

    @property
    def sleeping(self) -> bool:
        return self.health.status(self.now()) == "sleeping"
