"""LoopHistogram renders exactly what prometheus_client's labelled Histogram renders."""

from __future__ import annotations

import random
import re

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from splitserve.engine.loop_histogram import LoopHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1.0, 10.0)


def _exposition(registry: CollectorRegistry) -> str:
    """/metrics text with the `_created` timestamps (made at different instants) masked."""
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())


def test_same_exposition_as_prometheus_client():
    rng = random.Random(0)
    values = [rng.expovariate(30.0) for _ in range(2000)]
    values += [0.0, 0.001, 0.0025, 10.0, 25.0]  # on the bounds and past the last one
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("x:latency_seconds", "doc", {"model_name": "m"}, BUCKETS, ours)
    ref = Histogram("x:latency_seconds", "doc", ["model_name"], buckets=BUCKETS, registry=theirs)
    child = ref.labels(model_name="m")  # as ServerMetrics binds its label up front
    assert _exposition(ours) == _exposition(theirs)  # nothing observed yet
    for v in values:
        fast.observe(v)
        child.observe(v)
    assert _exposition(ours) == _exposition(theirs)
    assert 'x:latency_seconds_bucket{le="+Inf",model_name="m"} 2005.0' in _exposition(ours)
