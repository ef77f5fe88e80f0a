"""Transfer counters each connector keeps, and their Prometheus exposure.

Connectors only bump plain counters in `KVTransferStats` (from their I/O threads; single int/float
updates are atomic under the GIL). The serving layer exposes them by registering a
`KVTransferCollector` that reads the stats at scrape time, so nothing is counted twice and no
global Prometheus registry is touched at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class KVTransferStats:
    """Cumulative counters of one connector instance. Who sets this: the connector."""

    num_transfers: int = 0  # loads and saves that completed
    num_failed_transfers: int = 0  # loads and saves that failed (peer died, miss, mismatch, ...)
    transfer_seconds: float = 0.0  # sum of the durations of completed transfers
    bytes_loaded: int = 0  # bytes that landed in this instance's blocks
    bytes_saved: int = 0  # bytes this instance sent or stored for others
    blocks_loaded: int = 0
    blocks_saved: int = 0
    expired_leases: int = 0  # held requests freed because no consumer said done in time

    def record(self, seconds: float, nbytes: int, nblocks: int, loaded: bool) -> None:
        self.num_transfers += 1
        self.transfer_seconds += seconds
        if loaded:
            self.bytes_loaded += nbytes
            self.blocks_loaded += nblocks
        else:
            self.bytes_saved += nbytes
            self.blocks_saved += nblocks

    @property
    def mean_transfer_seconds(self) -> float:
        return self.transfer_seconds / self.num_transfers if self.num_transfers else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_HELP = {
    "num_transfers": ("splitserve:kv_transfer_total", "KV transfers (loads and saves) completed"),
    "num_failed_transfers": ("splitserve:kv_transfer_failed_total", "KV transfers that failed"),
    "transfer_seconds": (
        "splitserve:kv_transfer_seconds_total",
        "Seconds spent in completed KV transfers (divide by splitserve:kv_transfer_total)",
    ),
    "bytes_loaded": ("splitserve:kv_transfer_bytes_loaded_total", "KV bytes loaded"),
    "bytes_saved": ("splitserve:kv_transfer_bytes_saved_total", "KV bytes sent or stored"),
    "blocks_loaded": ("splitserve:kv_transfer_blocks_loaded_total", "KV blocks loaded"),
    "blocks_saved": ("splitserve:kv_transfer_blocks_saved_total", "KV blocks sent or stored"),
    "expired_leases": (
        "splitserve:kv_transfer_expired_leases_total",
        "Held requests freed because their lease ended before the consumer was done",
    ),
}


class KVTransferCollector:
    """Prometheus collector over connectors' stats: `REGISTRY.register(KVTransferCollector(f))`.

    `get_stats` returns {connector name: KVTransferStats}; it is called at each scrape.
    """

    def __init__(self, get_stats: Callable[[], dict[str, KVTransferStats]]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        stats = self._get_stats()
        for attr, (name, doc) in _HELP.items():
            # prometheus_client appends `_total` to counters itself.
            family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["connector"])
            for connector, s in sorted(stats.items()):
                family.add_metric([connector], getattr(s, attr))
            yield family

    def describe(self) -> Iterator[Any]:
        return iter(())
