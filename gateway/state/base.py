"""What every state store offers, and what both implementations share.

``lookup`` (auth) reads the local key cache and never does I/O. ``admit`` decides every limit of
a key in one step and returns an ``Admission`` or a ``Refusal``; ``settle`` ends it with the real
usage (fire and forget: it never delays a response). ``usage`` answers ``gateway usage``.
The key-management calls (``put_key``, ``get_key``, ``list_keys``) serve ``gateway keys``.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..config import ApiKeyConfig, GatewayConfig
from ..errors import Refusal
from .keys import KeyCache
from .limits import Admission, Decision, rate_headers, refusal_for
from . import stats

log = logging.getLogger("gateway.state")

HOUR = 3600


@dataclass(slots=True)
class UsageRow:
    key_hash: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    estimated: int = 0  # requests whose counts are the gateway's estimate (no usage in the response)


def hour_of(now: float) -> int:
    return int(now // HOUR) * HOUR


class StateStore:
    kind = "base"
    shared = False

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.cfg = config.state
        self.keys = KeyCache(config.auth.keys)
        self.replica = secrets.token_hex(6)
        self._lease_ids = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    # -- keys ------------------------------------------------------------------------------------
    def lookup(self, digest: bytes) -> ApiKeyConfig | None:
        return self.keys.lookup(digest)

    async def put_key(self, key: ApiKeyConfig) -> None:
        raise NotImplementedError

    async def get_key(self, digest: str) -> ApiKeyConfig | None:
        raise NotImplementedError

    async def list_keys(self) -> list[ApiKeyConfig]:
        raise NotImplementedError

    # -- limits ----------------------------------------------------------------------------------
    async def admit(self, key: ApiKeyConfig, model: str, prompt_estimate: int, max_tokens: int | None) -> Admission | Refusal:
        reserve = prompt_estimate + (max_tokens if max_tokens is not None else self.cfg.default_max_tokens) if key.rate_limit_tpm else 0
        granted = self._from_grant(key, reserve)
        if granted is not None:
            decision, lease, grant = granted
            return Admission(key, model, reserve, prompt_estimate, lease, True, rate_headers(key, decision), grant=grant)
        lease = f"{self.replica}.{next(self._lease_ids)}" if key.max_concurrent else ""  # unique over replicas, no syscall
        decision, shared, share = await self._decide(key, reserve, lease)
        if not decision.ok:
            stats.LIMIT_REFUSALS.labels(reason=decision.reason).inc()
            return refusal_for(key, decision, reserve, share)
        return Admission(key, model, reserve, prompt_estimate, lease, shared, rate_headers(key, decision, share))

    def unlimited(self, key: ApiKeyConfig, model: str, prompt_estimate: int | Callable[[], int]) -> Admission:
        """An admission for a key without limits: nothing to decide, only usage to count (the prompt
        estimate may be a callable, run only when the response carries no usage)."""
        return Admission(key, model, 0, prompt_estimate, "", self.shared)

    def _from_grant(self, key: ApiKeyConfig, reserve: int) -> tuple[Decision, str, Any] | None:
        """An admission decided from quota this process holds (the Redis store's grants), or None."""
        return None

    async def _decide(self, key: ApiKeyConfig, reserve: int, lease: str) -> tuple[Decision, bool, int]:
        raise NotImplementedError

    def settle(self, adm: Admission, outcome: Any) -> None:
        """End an admission with the response's usage (outcome: the router's, or None if none was sent)."""
        if adm.settled:
            return
        adm.settled = True
        ok = outcome is not None and getattr(outcome, "ok", False)
        prompt = getattr(outcome, "prompt_tokens", None) if outcome is not None else None
        completion = getattr(outcome, "completion_tokens", None) if outcome is not None else None
        estimated = ok and prompt is None
        if prompt is None:
            estimate = adm.prompt_estimate
            prompt = (estimate() if callable(estimate) else estimate) if ok else 0
        completion = completion or 0
        used = prompt + completion
        if ok:
            stats.record_usage(adm.key.name, adm.model, prompt, completion, estimated)
        self._settle(adm, used if ok else 0, prompt, completion, estimated, ok)

    def _settle(self, adm: Admission, used: int, prompt: int, completion: int, estimated: bool, counted: bool) -> None:
        raise NotImplementedError

    # -- usage -----------------------------------------------------------------------------------
    async def usage(self, key_hash: str | None = None, since: float | None = None) -> list[UsageRow]:
        raise NotImplementedError

    # -- shared load (sum of in-flight over replicas) ----------------------------------------------
    def remote_in_flight(self, backend_id: str) -> int:
        return 0


def now() -> float:
    return time.time()
