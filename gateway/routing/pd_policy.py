"""Choosing the two instances of a disaggregated (prefill/decode) request.

- **Prefill** by predicted time to first token: the prompt tokens this gateway has in flight on
  the instance plus the new prompt, times the instance's learnt seconds per prefill token. Prefix
  affinity: prompts that start alike prefer the same instance (rendezvous hashing on the start of
  the prompt), as long as that costs at most ``affinity_slack`` seconds over the best choice, so the
  instance's prefix cache is reused without piling work on one instance.
- **Decode** by decode load and KV room: fewer running decodes first, weighted by how full the KV
  cache would be with this request (capacity from ``/distserve/engine_info``: blocks x block size);
  an instance that cannot hold the request is used only when none can.

State is the picker's own (keyed by backend id), learnt from what the dispatcher reports.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .pool import Backend

DEFAULT_SECONDS_PER_TOKEN = 1 / 20000  # until the first prefill on an instance is measured
EWMA = 0.2
AFFINITY_PREFIX_BYTES = 512  # the start of the prompt that decides affinity


@dataclass
class _PrefillState:
    outstanding_tokens: int = 0
    seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN


@dataclass
class _DecodeState:
    running: int = 0
    reserved_tokens: int = 0
    capacity_tokens: int | None = None  # from /distserve/engine_info


class PDPicker:
    def __init__(self, affinity_slack: float = 0.25):
        self.affinity_slack = affinity_slack
        self._prefill: dict[str, _PrefillState] = {}
        self._decode: dict[str, _DecodeState] = {}

    # -- prefill -------------------------------------------------------------------------------
    def predicted_wait(self, b: Backend, tokens: int) -> float:
        st = self._prefill.get(b.id) or _PrefillState()
        return (st.outstanding_tokens + tokens) * st.seconds_per_token

    def pick_prefill(self, candidates: list[Backend], tokens: int, prefix: bytes) -> Backend:
        waits = {b.id: self.predicted_wait(b, tokens) for b in candidates}
        best = min(candidates, key=lambda b: (waits[b.id], b.in_flight))
        if prefix:
            head = prefix[:AFFINITY_PREFIX_BYTES]
            home = max(candidates, key=lambda b: hashlib.blake2b(head + b.id.encode(), digest_size=8).digest())
            if waits[home.id] <= waits[best.id] + self.affinity_slack:
                return home
        return best

    def prefill_started(self, b: Backend, tokens: int) -> None:
        self._prefill.setdefault(b.id, _PrefillState()).outstanding_tokens += tokens

    def prefill_done(self, b: Backend, tokens: int, seconds: float | None) -> None:
        st = self._prefill.setdefault(b.id, _PrefillState())
        st.outstanding_tokens = max(0, st.outstanding_tokens - tokens)
        if seconds is not None and tokens > 0:
            st.seconds_per_token += EWMA * (seconds / tokens - st.seconds_per_token)

    # -- decode --------------------------------------------------------------------------------
    def set_capacity(self, b: Backend, tokens: int) -> None:
        self._decode.setdefault(b.id, _DecodeState()).capacity_tokens = tokens

    def decode_score(self, b: Backend, tokens: int) -> tuple[int, float]:
        st = self._decode.get(b.id) or _DecodeState()
        if st.capacity_tokens:
            fill = (st.reserved_tokens + tokens) / st.capacity_tokens
            return (1 if fill > 1 else 0, (st.running + 1) / max(0.05, 1 - min(fill, 0.95)))
        return 0, float(st.running + 1)

    def pick_decode(self, candidates: list[Backend], tokens: int) -> Backend:
        return min(candidates, key=lambda b: (*self.decode_score(b, tokens), b.in_flight))

    def decode_started(self, b: Backend, tokens: int) -> None:
        st = self._decode.setdefault(b.id, _DecodeState())
        st.running += 1
        st.reserved_tokens += tokens

    def decode_done(self, b: Backend, tokens: int) -> None:
        st = self._decode.setdefault(b.id, _DecodeState())
        st.running = max(0, st.running - 1)
        st.reserved_tokens = max(0, st.reserved_tokens - tokens)

    def forget(self, backend_id: str) -> None:
        self._prefill.pop(backend_id, None)
        self._decode.pop(backend_id, None)
