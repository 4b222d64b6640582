"""Live figures for the status page: per-second request rate and latency, recent refusals, and per
backend counts, tokens and time to first token. Fed once per request by the listener; bounded in
memory whatever the traffic (fixed rings, a capped deque, per-backend entries dropped with the
backend)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW = 120  # seconds of history kept for the sparklines
RECENT_REFUSALS = 50


@dataclass
class BackendFigures:
    requests: int = 0
    errors: int = 0
    ttft_ewma: float | None = None  # seconds
    # (second, completion tokens) per second, for tokens/s over the last minute
    tokens: deque = field(default_factory=lambda: deque(maxlen=WINDOW))


class LiveStats:
    def __init__(self, clock=time.time):
        self.clock = clock
        self._second = [0] * WINDOW  # which absolute second each slot holds
        self._count = [0] * WINDOW
        self._latency = [0.0] * WINDOW
        self.refusals: deque[tuple[float, str, int]] = deque(maxlen=RECENT_REFUSALS)
        self.refusal_counts: dict[str, int] = {}
        self.backends: dict[str, BackendFigures] = {}
        self.total = 0

    def observe(self, ctx: Any, status: int, seconds: float, refusal: str | None = None) -> None:
        """One finished request; ``ctx`` is None when it was refused before it matched a route."""
        now = self.clock()
        sec = int(now)
        i = sec % WINDOW
        if self._second[i] != sec:
            self._second[i], self._count[i], self._latency[i] = sec, 0, 0.0
        self._count[i] += 1
        self._latency[i] += seconds
        self.total += 1
        if refusal is not None:
            self.refusals.append((now, refusal, status))
            if refusal in self.refusal_counts or len(self.refusal_counts) < 256:  # reasons are a closed set; bound anyway
                self.refusal_counts[refusal] = self.refusal_counts.get(refusal, 0) + 1
        if ctx is not None and ctx.backend is not None:
            b = self.backends.get(ctx.backend)
            if b is None:
                b = self.backends[ctx.backend] = BackendFigures()
            b.requests += 1
            if status >= 500:
                b.errors += 1
            outcome = ctx.outcome
            if outcome is not None:
                if outcome.ttft is not None:
                    b.ttft_ewma = outcome.ttft if b.ttft_ewma is None else 0.8 * b.ttft_ewma + 0.2 * outcome.ttft
                if outcome.completion_tokens:
                    if b.tokens and b.tokens[-1][0] == sec:
                        b.tokens[-1] = (sec, b.tokens[-1][1] + outcome.completion_tokens)
                    else:
                        b.tokens.append((sec, outcome.completion_tokens))

    def forget(self, backend_id: str) -> None:
        self.backends.pop(backend_id, None)

    def series(self, seconds: int = 60) -> dict[str, list[float]]:
        """Requests per second and mean latency (ms) for each of the last ``seconds`` whole seconds."""
        now = int(self.clock())
        rate, latency = [], []
        for sec in range(now - seconds + 1, now + 1):  # the last one is the second under way
            i = sec % WINDOW
            n = self._count[i] if self._second[i] == sec else 0
            rate.append(float(n))
            latency.append(round(self._latency[i] / n * 1000, 3) if n else 0.0)
        return {"rate": rate, "latency_ms": latency}

    def backend(self, backend_id: str, window: int = 60) -> dict[str, Any]:
        b = self.backends.get(backend_id)
        if b is None:
            return {"requests": 0, "errors": 0, "ttft_ms": None, "tokens_per_s": 0.0}
        since = int(self.clock()) - window
        tokens = sum(n for sec, n in b.tokens if sec >= since)
        return {
            "requests": b.requests,
            "errors": b.errors,
            "ttft_ms": round(b.ttft_ewma * 1000, 1) if b.ttft_ewma is not None else None,
            "tokens_per_s": round(tokens / window, 2),
        }

    def recent_refusals(self) -> list[dict[str, Any]]:
        return [{"at": round(t, 3), "reason": r, "status": s} for t, r, s in reversed(self.refusals)]
