"""A Prometheus histogram for the front end's event loop: plain counts, rendered at scrape time.

prometheus_client's Histogram takes a lock for the sum and one for a bucket and walks the buckets
one by one: about 2 µs an observation. The inter-token latency is observed once per token of every
running request, all in the one thread that runs the front end's event loop (the output loop, the
handlers and the /metrics route), so no lock is needed: an observation here is a bisect and two
additions. `collect` yields the samples prometheus_client's labelled Histogram yields (the same
names, labels, label order and float values, `_created` included unless disabled), so /metrics
reads the same.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import INF, floatToGoString


class LoopHistogram:
    """One labelled histogram series, observed only from the event loop's thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"histogram {name}: buckets not in sorted order")
        if bounds[-1] != INF:
            bounds.append(INF)
        self._name, self._documentation, self._labels = name, documentation, dict(labels)
        self._bounds = bounds
        self._le = [floatToGoString(b) for b in bounds]
        self._counts = [0.0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        """Count `amount` in the first bucket whose upper bound is >= it (Prometheus' `le`)."""
        self._counts[bisect_left(self._bounds, amount)] += 1.0
        self._sum += amount

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, "histogram")
        labels, acc = self._labels, 0.0
        for le, count in zip(self._le, self._counts, strict=True):
            acc += count
            metric.add_sample(self._name + "_bucket", {**labels, "le": le}, acc)
        metric.add_sample(self._name + "_count", dict(labels), acc)
        if self._bounds[0] >= 0:  # as prometheus_client: no sum when negatives may count
            metric.add_sample(self._name + "_sum", dict(labels), self._sum)
        # prometheus_client's own switch (env PROMETHEUS_DISABLE_CREATED_SERIES or
        # disable_created_metrics()), so this series follows the registry's other metrics.
        if getattr(prometheus_metrics, "_use_created", True):
            metric.add_sample(self._name + "_created", dict(labels), self._created)
        return [metric]
