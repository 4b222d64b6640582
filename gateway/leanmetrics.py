"""Lock-free counters and histograms for the series updated on every forwarded request.

prometheus_client's ``Counter.inc`` and ``Histogram.observe`` take a lock, validate, and walk the
buckets in Python: about 5 µs of CPU per forwarded request over the four hot series. Here a child
is a plain number (a counter) or a list of bucket counts and a sum (a histogram, one ``bisect``
and two adds per observation). That is safe because the gateway updates them from its one event
loop thread; the exposition reads plain numbers, and under the GIL a read in another thread sees
whole values.

Each metric is its own Collector, registered where the prometheus_client one was, so
``generate_latest`` writes the same text: names, HELP, TYPE, labels, ``le`` strings, float values,
cumulative buckets and ``_created`` (following prometheus_client's switch for it).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as _prom_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString


def _with_created() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics()).
    return _prom_metrics._use_created


class _Family(Collector):
    """The labelled parent: its children by label values, in the order they were first asked for."""

    _type = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry | None):
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if registry is not None:
            registry.register(self)

    def _values(self, labelvalues: dict[str, object]) -> tuple[str, ...]:
        if set(labelvalues) != set(self._labelnames):
            raise ValueError(f"{self._name}: labels {sorted(labelvalues)} are not {list(self._labelnames)}")
        return tuple(str(labelvalues[n]) for n in self._labelnames)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, self._type)]


class CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0
        self.created = time.time()

    def inc(self, amount: int | float = 1) -> None:
        # No check for a negative amount: the callers add 1 or a token count already bounded to >= 0.
        self.value += amount


class LeanCounter(_Family):
    _type = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry | None):
        # prometheus_client names a counter's family without "_total" and adds it to the sample.
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def labels(self, **labelvalues: object) -> CounterChild:
        """The child for these label values; look it up once and keep it (this validates)."""
        key = self._values(labelvalues)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = CounterChild()
        return child  # type: ignore[return-value]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, self._type)
        created = _with_created()
        total, stamp = self._name + "_total", self._name + "_created"
        for key, child in list(self._children.items()):
            labels = dict(zip(self._labelnames, key))
            metric.add_sample(total, labels, float(child.value))  # type: ignore[attr-defined]
            if created:
                metric.add_sample(stamp, labels, child.created)  # type: ignore[attr-defined]
        return [metric]


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative: the exposition adds them up
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # bisect_left: a value equal to a bound lands in that bucket (le is inclusive); the last
        # bound is +Inf, so every number has a bucket.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class LeanHistogram(_Family):
    _type = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float], registry: CollectorRegistry | None):
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self._bounds = tuple(bounds)
        self._le = tuple(floatToGoString(b) for b in bounds)
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, **labelvalues: object) -> HistogramChild:
        """The child for these label values; look it up once and keep it (this validates)."""
        key = self._values(labelvalues)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HistogramChild(self._bounds)
        return child  # type: ignore[return-value]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, self._type)
        created = _with_created()
        name = self._name
        for key, child in list(self._children.items()):
            labels = dict(zip(self._labelnames, key))
            counts = list(child.counts)  # type: ignore[attr-defined]
            acc = 0.0
            for le, n in zip(self._le, counts):
                acc += n
                metric.add_sample(name + "_bucket", {**labels, "le": le}, acc)
            metric.add_sample(name + "_count", labels, acc)
            if self._bounds[0] >= 0:  # as prometheus_client: no _sum when a bucket is below zero
                metric.add_sample(name + "_sum", labels, child.sum)  # type: ignore[attr-defined]
            if created:
                metric.add_sample(name + "_created", labels, child.created)  # type: ignore[attr-defined]
        return [metric]
