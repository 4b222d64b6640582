"""``/metrics`` with lmdeploy's metric names, in a registry private to one simulator.

Like the real server, the load gauges are snapshots refreshed every ``--metrics-interval``
seconds (lmdeploy's ``_force_log`` loop runs every 10 s), so a router that trusts them alone
sees stale load; counters and histograms are live.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import Engine, Sequence

_LABELS = ("model_name", "engine")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class SimMetrics:
    def __init__(self, model_name: str, max_batch_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.max_batch_size = max_batch_size
        r, labels = self.registry, {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=r).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)

        self.running = gauge("lmdeploy:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("lmdeploy:num_requests_waiting", "Number of requests waiting to be processed.")
        self.routed = gauge("lmdeploy:num_api_requests_routed", "Number of requests holding an API request handle.")
        self.api_waiting = gauge("lmdeploy:num_api_requests_waiting", "Number of requests waiting for a free API request handle.")
        self.cache_usage = gauge("lmdeploy:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
        self.hit_rate = gauge("lmdeploy:prefix_cache_hit_rate", "Prefix cache hit rate.")
        self.prompt_tokens = counter("lmdeploy:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("lmdeploy:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("lmdeploy:cached_tokens", "Number of prompt tokens served from the prefix cache.")
        self.ttft = histogram("lmdeploy:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.e2e = histogram("lmdeploy:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.")

    # EngineObserver
    def on_admitted(self, seq: Sequence) -> None:
        self.prompt_tokens.inc(seq.prompt.tokens)
        if seq.cached_tokens:
            self.cached_tokens.inc(seq.cached_tokens)

    def on_finished(self, seq: Sequence) -> None:
        if seq.generated:
            self.generation_tokens.inc(seq.generated)
        if seq.first_token_at is not None:
            self.ttft.observe(seq.first_token_at - seq.submitted_at)
        if seq.finished_at is not None and not seq.aborted:
            self.e2e.observe(seq.finished_at - seq.submitted_at)

    def refresh(self, engine: Engine) -> None:
        """Take the gauge snapshot that scrapes will see until the next refresh."""
        in_flight = engine.in_flight
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        # lmdeploy's request-handle pool has max_batch_size handles; the rest wait for one.
        self.routed.set(min(in_flight, self.max_batch_size))
        self.api_waiting.set(max(0, in_flight - self.max_batch_size))
        self.cache_usage.set(engine.kv_usage)
        stats = engine.stats
        self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
