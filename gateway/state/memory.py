"""The in-memory store: one process, nothing shared (the default, what the quickstart uses).

Keys come from the config and its keys file; ``gateway keys`` edits the keys file, which the
running gateway reloads (see ``reload.py``). Usage is kept per key, model and hour for
``state.usage_retention_days`` (as Redis keeps it); ``gateway usage`` reads it through the admin
listener (``GET /admin/usage``).
"""

from __future__ import annotations

import time

from ..config import ApiKeyConfig
from .base import StateStore, UsageRow, hour_of
from .limits import Admission, Decision, LocalLimiter


class MemoryStore(StateStore):
    kind = "memory"
    shared = False

    def __init__(self, config, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config)
        self.limiter = LocalLimiter(clock)
        self._usage: dict[tuple[int, str, str], UsageRow] = {}
        self._hour = 0  # the hour of the last row added; a new one prunes the rows past retention

    async def put_key(self, key: ApiKeyConfig) -> None:
        self.keys.put_store_key(key.hash, key)

    async def get_key(self, digest: str) -> ApiKeyConfig | None:
        return self.keys.lookup(bytes.fromhex(digest.removeprefix("sha256:")))

    async def list_keys(self) -> list[ApiKeyConfig]:
        return self.keys.all()

    async def _decide(self, key: ApiKeyConfig, reserve: int, lease: str) -> tuple[Decision, bool, int]:
        return self.limiter.admit(key, reserve, lease), False, 1

    def _settle(self, adm: Admission, used: int, prompt: int, completion: int, estimated: bool, counted: bool) -> None:
        if adm.key.limited:
            self.limiter.settle(adm.key, adm.reserved, used, adm.lease)
        if counted:
            hour = hour_of(time.time())
            if hour != self._hour:
                self._hour = hour
                self._prune(hour)
            k = (hour, adm.key.hash, adm.model)
            row = self._usage.get(k)
            if row is None:
                row = self._usage[k] = UsageRow(adm.key.hash, adm.model)
            row.prompt_tokens += prompt
            row.completion_tokens += completion
            row.requests += 1
            row.estimated += int(estimated)

    def _prune(self, hour: int) -> None:
        """Bounded like Redis's hourly hashes: rows older than the retention go (once an hour)."""
        oldest = hour - self.cfg.usage_retention_days * 86400
        for k in [k for k in self._usage if k[0] < oldest]:
            del self._usage[k]

    async def usage(self, key_hash: str | None = None, since: float | None = None) -> list[UsageRow]:
        return merge_rows(row for (hour, h, _), row in self._usage.items() if (key_hash is None or h == key_hash) and (since is None or hour + 3600 > since))


def merge_rows(rows) -> list[UsageRow]:  # type: ignore[no-untyped-def]
    out: dict[tuple[str, str], UsageRow] = {}
    for r in rows:
        acc = out.get((r.key_hash, r.model))
        if acc is None:
            acc = out[(r.key_hash, r.model)] = UsageRow(r.key_hash, r.model)
        acc.prompt_tokens += r.prompt_tokens
        acc.completion_tokens += r.completion_tokens
        acc.requests += r.requests
        acc.estimated += r.estimated
    return sorted(out.values(), key=lambda r: (r.key_hash, r.model))
