"""Redis connector: full KV blocks stored under their content hash, shared by every instance.

Key `{key_prefix}:{model_fingerprint}:{block_hash_hex}`; the chained block hash names a prefix of
tokens, the fingerprint the model/dtype/block size, so equal keys mean interchangeable bytes.
Value: a 16-byte header + the block. scheduler.py holds the scheduler side, store.py all of the
worker side's Redis I/O.

- Lookup (scheduler side, any instance): pipelined EXISTS over the request's full prompt blocks
  past its local prefix-cache hit; the leading run of hits is loadable. A cross-instance prefix
  cache, P/D or not.
- Load (worker, background thread): pipelined GETs straight into the allocated blocks. A P/D
  load (`do_remote_prefill`) waits up to `wait_s` for blocks its producer has not written yet:
  the producer writes one step after answering the router.
- Save (worker, background thread): at `save_kv` after `request_finished`, the finished
  request's full blocks that did not come from the store. The blocks stay held (delay_free)
  until the write is done or failed, then `done_sending`. Writing blocks as they fill would need
  per-step scheduling output, which this interface does not carry.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from pydantic import Field

from splitserve.kv_connector.base import (
    EngineInfo,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from splitserve.kv_connector.config import ConnectorOptions, KVTransferConfig
from splitserve.kv_connector.hugepages import use_huge_pages
from splitserve.kv_connector.layout import block_bytes
from splitserve.kv_connector.redis.scheduler import (
    PendingLookup,
    RedisMetadata,
    RedisSchedulerSide,
    StoreLoad,
    StoreSave,
)
from splitserve.kv_connector.redis.store import BlockStore

if TYPE_CHECKING:
    import redis
    import torch

logger = logging.getLogger(__name__)


class RedisOptions(ConnectorOptions):
    url: str = "redis://127.0.0.1:6379/0"
    """Redis server (redis://, rediss:// or unix://)."""
    ttl_s: float | None = Field(default=3600.0, gt=0)
    """Expiry of stored blocks; null keeps them until Redis evicts them."""
    key_prefix: str = "splitserve:kv"
    timeout_s: float = Field(default=5.0, gt=0)
    """Socket timeout of loads and saves."""
    lookup_timeout_s: float = Field(default=0.5, gt=0)
    """Socket timeout of the scheduler's EXISTS lookups (a miss costs a recompute, not a wait)."""
    wait_s: float = Field(default=5.0, ge=0)
    """How long a P/D load waits for blocks its producer has not stored yet."""
    max_pipeline_bytes: int = Field(default=2 << 20, gt=0)
    """Split pipelines so one round trip carries at most this many bytes (redis-server builds a
    pipeline's whole reply before sending it: 1–4 MiB read twice as fast as 64 MiB)."""


class RedisConnector(RedisSchedulerSide, KVConnectorBase):
    Options = RedisOptions

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, engine_info: EngineInfo
    ) -> None:
        super().__init__(config, role, engine_info)
        self._prefix = f"{self.options.key_prefix}:{engine_info.model_fingerprint}:"
        # Scheduler side.
        self._lookup_client: redis.Redis | None = None
        self._lookup_down_until = 0.0  # after a failed lookup, skip lookups for a while
        self._pending: dict[str, PendingLookup] = {}
        self._loaded_blocks: dict[str, int] = {}  # request → blocks [0, n) known to be stored
        self._meta = RedisMetadata()
        # Worker side.
        self.blocks: torch.Tensor | None = None
        self._threads: list[threading.Thread] = []
        self._loads: queue.SimpleQueue[StoreLoad | None] = queue.SimpleQueue()
        self._saves: queue.SimpleQueue[StoreSave | None] = queue.SimpleQueue()

    def _store(self) -> BlockStore:
        """A connection for one worker thread."""
        o = self.options
        return BlockStore(o.url, o.timeout_s, o.max_pipeline_bytes, self.config.verify, o.ttl_s)

    # ============================================================ worker side
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        info = self.engine_info
        self.blocks = block_bytes(kv_cache, info.num_blocks, info.block_nbytes)
        use_huge_pages(kv_cache)  # the kernel copies socket data through these pages
        for name, target in (("load", self._load_loop), ("save", self._save_loop)):
            thread = threading.Thread(
                target=target, daemon=True, name=f"kv-redis-{name}-{info.engine_id}"
            )
            thread.start()
            self._threads.append(thread)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, RedisMetadata), type(meta)
        for load in meta.loads:
            self._loads.put(load)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, RedisMetadata), type(meta)
        for save in meta.saves:
            self._saves.put(save)

    def shutdown(self) -> None:
        self._loads.put(None)
        self._saves.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    # ------------------------------------------------------------ background threads
    def _load_loop(self) -> None:
        store = self._store()
        while (load := self._loads.get()) is not None:
            started = time.monotonic()
            try:
                assert self.blocks is not None
                wait_s = self.options.wait_s if load.wait else 0.0
                error = load.error or store.load(self.blocks, load.block_ids, load.keys, wait_s)
            except Exception as e:  # redis errors, and anything unexpected: never hang
                error = f"Redis load failed: {type(e).__name__}: {e}"
            n = len(load.block_ids)
            if error is None:
                self.stats.record(
                    time.monotonic() - started, n * self.engine_info.block_nbytes, n, loaded=True
                )
                self.finished.recved(load.request_id)
            else:
                self.stats.num_failed_transfers += 1
                logger.warning("%s: KV load failed: %s", load.request_id, error)
                self.finished.failed(load.request_id, error)
        store.close()

    def _save_loop(self) -> None:
        store = self._store()
        while (save := self._saves.get()) is not None:
            started = time.monotonic()
            try:
                assert self.blocks is not None
                store.save(self.blocks, save.block_ids, save.keys)
                n = len(save.block_ids)
                self.stats.record(
                    time.monotonic() - started, n * self.engine_info.block_nbytes, n, loaded=False
                )
            except Exception as e:
                self.stats.num_failed_transfers += 1
                logger.warning(
                    "%s: KV save to Redis failed: %s: %s", save.request_id, type(e).__name__, e
                )
            self.finished.sent(save.request_id)  # the blocks may be freed either way
        store.close()
