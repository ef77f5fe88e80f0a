"""The router's Prometheus metrics (`splitserve:router_*`), on a registry of its own.

A registry per router (not prometheus_client's global one) lets tests build several apps in one
process without "duplicated timeseries" errors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve:router_requests", "Requests received",
                                ["endpoint", "mode"], registry=r)
        self.errors = Counter("splitserve:router_errors", "Requests answered with an error",
                              ["kind"], registry=r)
        self.retries = Counter("splitserve:router_retries",
                               "Prefill attempts retried on another instance", registry=r)
        self.fallbacks = Counter("splitserve:router_fallbacks",
                                 "Requests served decode-only because no prefill answered",
                                 registry=r)
        self.ttft = Histogram("splitserve:router_time_to_first_token_seconds",
                              "Arrival to first token sent", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.latency = Histogram("splitserve:router_request_latency_seconds",
                                 "Arrival to last byte sent", buckets=_LATENCY_BUCKETS,
                                 registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
