"""Live signals from the backends' own /metrics, for the balancer.

``MetricsScraper`` polls each healthy backend's /metrics every ``balancer.scrape_interval``
seconds, parses LMDeploy's gauges and keeps one ``Signals`` per backend id (dropped when the
backend leaves the pool). After every poll it calls the balancer's
``observe_signals(backend, signals, changed)``. LMDeploy refreshes these gauges only every 10 s, so
``changed`` matters more than the poll itself: until the numbers change, the balancer keeps
crediting the work it dispatched since the last change.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import httpx

from ..upstream import control_call
from .periodic import Periodic

if TYPE_CHECKING:
    from .pool import Backend

log = logging.getLogger("gateway.signals")
MAX_METRICS_BODY = 4 << 20  # lmdeploy's exposition is tens of KiB; a backend is not trusted to keep it so

RUNNING = "lmdeploy:num_requests_running"
WAITING = "lmdeploy:num_requests_waiting"
KV_USAGE = "lmdeploy:gpu_cache_usage_perc"
PREFIX_HIT_RATE = "lmdeploy:prefix_cache_hit_rate"
GENERATION_TOKENS = "lmdeploy:generation_tokens_total"
PROMPT_TOKENS = "lmdeploy:prompt_tokens_total"
_WANTED = frozenset((RUNNING, WAITING, KV_USAGE, PREFIX_HIT_RATE, GENERATION_TOKENS, PROMPT_TOKENS))
_MEANS = frozenset((KV_USAGE, PREFIX_HIT_RATE))  # ratios: averaged across engines (DP ranks), not summed


@dataclass(slots=True)
class Signals:
    running: float = 0.0  # sequences in the engine's batches
    waiting: float = 0.0  # queued in the engine
    kv_usage: float = 0.0  # 0..1
    prefix_hit_rate: float = 0.0
    tokens: float = 0.0  # prompt + generation tokens, cumulative
    token_rate: float = 0.0  # tokens per second between the last two changes of the counters
    changed_at: float = 0.0  # when a poll last saw different numbers
    scraped_at: float = 0.0  # last successful poll
    tokens_at: float = 0.0  # when ``tokens`` last changed
    max_age: float = 30.0  # older than this, the numbers are ignored

    def fresh(self, now: float) -> bool:
        return self.scraped_at > 0.0 and now - self.scraped_at <= self.max_age


def parse_metrics(text: str) -> dict[str, float]:
    """The LMDeploy series we use, summed over label sets (ratios averaged); others are skipped."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("lmdeploy:"):
            continue
        end = len(line)
        for i, ch in enumerate(line):
            if ch == "{" or ch == " ":
                end = i
                break
        name = line[:end]
        if name not in _WANTED:
            continue
        rest = line[end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                continue
            rest = rest[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    for name in _MEANS & sums.keys():
        sums[name] /= counts[name]
    return sums


def update_signals(sig: Signals, values: dict[str, float], now: float) -> bool:
    """Fold one poll into ``sig``; True when the gauges changed since the previous poll."""
    running = values.get(RUNNING, 0.0)
    waiting = values.get(WAITING, 0.0)
    kv = min(1.0, max(0.0, values.get(KV_USAGE, 0.0)))
    hit = values.get(PREFIX_HIT_RATE, 0.0)
    tokens = values.get(GENERATION_TOKENS, 0.0) + values.get(PROMPT_TOKENS, 0.0)
    first = sig.scraped_at == 0.0
    # Only the gauges: LMDeploy refreshes them every 10 s, while its counters move on every poll.
    changed = first or (running, waiting, kv, hit) != (sig.running, sig.waiting, sig.kv_usage, sig.prefix_hit_rate)
    if tokens != sig.tokens:
        if not first and sig.tokens_at and tokens >= sig.tokens and now > sig.tokens_at:
            sig.token_rate = (tokens - sig.tokens) / (now - sig.tokens_at)
        sig.tokens = tokens
        sig.tokens_at = now
    sig.running, sig.waiting, sig.kv_usage, sig.prefix_hit_rate = running, waiting, kv, hit
    sig.scraped_at = now
    if changed:
        sig.changed_at = now
    return changed


def learn_slots(slots: int | None, sig: Signals) -> int | None:
    """A backend's batch slots after a poll that changed the gauges: a real queue (not the few that
    arrived during one step) while the KV cache has room means every slot is taken; more running than
    assumed means more slots. Only ever raises what it is given (a configured or launched count)."""
    if sig.running > 0 and sig.waiting >= max(2.0, 0.25 * sig.running) and sig.kv_usage < 0.8:
        return max(slots or 0, int(sig.running))
    if slots is not None and sig.running > slots:
        return int(sig.running)
    return slots


class MetricsScraper:
    """Polls /metrics of every healthy backend; one task, bounded by its interval and timeout."""

    def __init__(
        self,
        backends: Callable[[], Iterable[Backend]],
        on_sample: Callable[[Backend, Signals, bool], None],
        *,
        interval: float = 2.0,
        timeout: float = 2.0,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if interval <= 0:
            raise ValueError("scrape interval must be positive")
        self.backends = backends
        self.on_sample = on_sample
        self.interval = interval
        self.timeout = min(timeout, interval * 4)
        self.clock = clock
        self._client = client
        self._periodic = Periodic("metrics-scraper", self.scrape_all, lambda: self.interval, log)
        self.failures = 0  # polls that got no usable answer
        self.signals: dict[str, Signals] = {}  # by backend id

    async def scrape(self, b: Backend) -> bool:
        client = self._client
        assert client is not None, "scraper has no HTTP client"
        try:
            status, body = await control_call(client, "GET", f"{b.url}/metrics", headers=b.auth_headers(), limit=MAX_METRICS_BODY, timeout=self.timeout)
            if status != 200 or body is None:
                raise ValueError(f"status {status}" if body is not None else "body too large")  # never read whole
            values = parse_metrics(body.decode("utf-8", "replace"))
        except (httpx.HTTPError, OSError, ValueError, asyncio.TimeoutError) as exc:
            self.failures += 1
            log.debug("metrics of backend %s unavailable: %s", b.id, exc.__class__.__name__)
            return False
        if not values:
            return False  # not an LMDeploy server, or metrics disabled (--enable-metrics)
        sig = self.signals.get(b.id)
        if sig is None:
            sig = self.signals[b.id] = Signals(max_age=max(30.0, 3 * self.interval))
        changed = update_signals(sig, values, self.clock())
        self.on_sample(b, sig, changed)
        return True

    async def scrape_all(self) -> None:
        backends = list(self.backends())
        if len(self.signals) > len(backends):  # some left the pool: their numbers go with them
            present = {b.id for b in backends}
            for gone in [i for i in self.signals if i not in present]:
                del self.signals[gone]
        await asyncio.gather(*(self.scrape(b) for b in backends if b.healthy))

    def start(self, client: httpx.AsyncClient | None = None) -> None:
        if client is not None:
            self._client = client
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
