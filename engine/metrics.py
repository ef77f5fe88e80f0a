"""Prometheus metrics of one instance, named `splitserve:...` (vLLM's `vllm:...` set).

Latencies are observed in the front end, where the client's view of time is: TTFT from the
request's arrival to its first token, inter-token latency between consecutive token updates,
end-to-end from arrival to finish. Engine state (running/waiting, KV usage, prefix-cache hits) is
read from the core at scrape time by `update_engine_stats`, so the hot path pays nothing for it.
KV-transfer counters come from the core's connectors through `KVTransferCollector`.

Each ServerMetrics owns its registry: two servers in one process (tests) never collide, and
nothing global is touched at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from splitserve.engine.loop_histogram import LoopHistogram
from splitserve.kv_connector.metrics import KVTransferCollector, KVTransferStats

if TYPE_CHECKING:
    from splitserve.engine.output_processor import RequestOutput
    from splitserve.engine.request_stream import RequestStream

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The metric objects, bound to the served model's label."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self._model_name = model_name
        label = {"model_name": model_name}

        # Registration order is the order of /metrics. Latencies are observed on the event
        # loop's hot path: LoopHistogram (no locks).
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LoopHistogram:
            return LoopHistogram(f"splitserve:{name}", doc, label, buckets, r)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"splitserve:{name}", doc, list(label), registry=r).labels(**label)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"splitserve:{name}", doc, list(label), registry=r).labels(**label)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive token updates of a request",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token", _E2E_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self._success = Counter(
            "splitserve:request_success",
            "Finished requests by reason",
            [*label, "finished_reason"],
            registry=r,
        )
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled (incl. remote KV loads)"
        )
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.kv_blocks_free = gauge("kv_cache_blocks_free", "Free KV blocks")
        self.prefix_hit_rate = gauge(
            "prefix_cache_hit_rate", "Prefix-cache hits / queries (blocks) since start"
        )
        self.prefix_queries = gauge(
            "prefix_cache_queries", "Prefix-cache block queries since start"
        )
        self.prefix_hits = gauge("prefix_cache_hits", "Prefix-cache block hits since start")
        self.preemptions = gauge("num_preemptions", "Preemptions since start")
        self._transfer_stats: dict[str, KVTransferStats] = {}
        r.register(KVTransferCollector(lambda: self._transfer_stats))

    # -------------------------------------------------------------------- hot path (front end)
    def observe_tokens(self, stream: RequestStream, now: float) -> None:
        """A token update of `stream` arrived at `now` (before `stream.last_token_time` moves)."""
        if stream.last_token_time is None:
            self.ttft.observe(now - stream.arrival)
        else:
            self.itl.observe(now - stream.last_token_time)

    def observe_step(self, num_new_tokens: int) -> None:
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)

    def observe_finished(self, stream: RequestStream, now: float, out: RequestOutput) -> None:
        self.e2e.observe(now - stream.arrival)
        self.prompt_tokens.inc(stream.prompt_len)
        reason = out.outputs[0].finish_reason or "unknown"
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()

    # -------------------------------------------------------------------- scrape time
    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        self.kv_blocks_free.set(stats.get("kv_blocks_free", 0))
        queries = stats.get("prefix_cache_queries", 0)
        hits = stats.get("prefix_cache_hits", 0)
        self.prefix_queries.set(queries)
        self.prefix_hits.set(hits)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self.preemptions.set(stats.get("num_preemptions", 0))
        self._transfer_stats = {
            name: KVTransferStats(**counters)
            for name, counters in (stats.get("kv_transfer") or {}).items()
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
