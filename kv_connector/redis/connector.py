"""Redis connector: full KV blocks stored under their content hash, shared by every instance.

Key `{key_prefix}:{model_fingerprint}:{block_hash_hex}`; the chained block hash names a prefix of
tokens, the fingerprint the model/dtype/block size, so equal keys mean interchangeable bytes.
Value: a 16-byte header (magic, flags, xxhash64 of the payload when verify is on) + the block.

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
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash
from pydantic import Field

from splitserve.kv_connector.base import (
    EngineInfo,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    RequestView,
)
from splitserve.kv_connector.config import ConnectorOptions, KVTransferConfig
from splitserve.kv_connector.layout import block_bytes, block_range, bounded_put
from splitserve.kv_connector.redis.resp import BlockReader

if TYPE_CHECKING:
    import redis
    import torch

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sIQ")  # magic, flags, checksum
_MAGIC = b"SSKV"
_HAS_CHECKSUM = 1
_LOOKUP_BACKOFF_S = 5


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
    max_pipeline_bytes: int = Field(default=64 << 20, gt=0)
    """Split pipelines so one round trip carries at most this many bytes."""


class StoreLoad(msgspec.Struct, kw_only=True):
    request_id: str
    block_ids: list[int]
    keys: list[str]
    wait: bool  # P/D: the producer may not have written them yet
    error: str | None = None


class StoreSave(msgspec.Struct, kw_only=True):
    request_id: str
    block_ids: list[int]
    keys: list[str]


class RedisMetadata(KVConnectorMetadata, kw_only=True):
    loads: list[StoreLoad] = msgspec.field(default_factory=list)
    saves: list[StoreSave] = msgspec.field(default_factory=list)


@dataclass
class _Pending:
    keys: list[str]  # of the blocks from num_computed_tokens on
    num_computed_tokens: int
    wait: bool
    error: str | None = None


class RedisConnector(KVConnectorBase):
    Options = RedisOptions

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, engine_info: EngineInfo
    ) -> None:
        super().__init__(config, role, engine_info)
        self._prefix = f"{self.options.key_prefix}:{engine_info.model_fingerprint}:"
        # Scheduler side.
        self._lookup_client: redis.Redis | None = None
        self._lookup_down_until = 0.0  # after a failed lookup, skip lookups for a while
        self._pending: dict[str, _Pending] = {}
        self._loaded_blocks: dict[str, int] = {}  # request → blocks [0, n) known to be stored
        self._meta = RedisMetadata()
        # Worker side.
        self.blocks: torch.Tensor | None = None
        self._threads: list[threading.Thread] = []
        self._loads: queue.SimpleQueue[StoreLoad | None] = queue.SimpleQueue()
        self._saves: queue.SimpleQueue[StoreSave | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: dict[str, str] = {}

    def _client(self, timeout_s: float) -> redis.Redis:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One immediate retry (a stale pooled connection), never a backoff: a load or a lookup
        # that cannot reach the store should fail within timeout_s, not after a retry schedule.
        return redis.Redis.from_url(
            self.options.url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )

    def key(self, block_hash: bytes) -> str:
        return self._prefix + block_hash.hex()

    # ============================================================ scheduler side
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.is_consumer:
            return 0, False
        bs = self.engine_info.block_size
        params = request.kv_transfer_params or {}
        first = num_computed_tokens // bs
        last = min(len(request.block_hashes), request.num_prompt_tokens // bs)
        keys = [self.key(h) for h in request.block_hashes[first:last]]
        wait, error = bool(params.get("do_remote_prefill")), None
        if wait:
            num_blocks = min(int(params.get("num_tokens") or 0) // bs, last) - first
            theirs = params.get("block_hashes") or []
            ours = [h.hex() for h in request.block_hashes[: len(theirs)]]
            if params.get("connector") not in (None, self.config.connector):
                error = (
                    f"the producer serves this KV with connector {params['connector']!r}, "
                    f"this instance uses {self.config.connector!r}"
                )
            elif theirs and theirs != ours[: len(theirs)]:
                error = (
                    "block hashes differ from the producer's (different tokens, "
                    "model or block size)"
                )
        else:
            num_blocks = self._count_stored(keys, request.request_id)
        num = min((first + max(num_blocks, 0)) * bs, request.num_prompt_tokens - 1)
        num -= num_computed_tokens
        if num <= 0:
            return 0, False
        bounded_put(
            self._pending, request.request_id, _Pending(keys, num_computed_tokens, wait, error)
        )
        return num, True

    def _count_stored(self, keys: list[str], request_id: str) -> int:
        """Length of the leading run of keys present in the store (0 when it is unreachable:
        then lookups pause for a few seconds, so a hung server cannot stall every request)."""
        if not keys or time.monotonic() < self._lookup_down_until:
            return 0
        import redis

        try:
            if self._lookup_client is None:
                self._lookup_client = self._client(self.options.lookup_timeout_s)
            pipe = self._lookup_client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            found = pipe.execute()
        except redis.RedisError as e:
            self._lookup_down_until = time.monotonic() + _LOOKUP_BACKOFF_S
            logger.warning(
                "%s: Redis lookup failed (%s); computing locally, no lookups for %ds",
                request_id,
                e,
                _LOOKUP_BACKOFF_S,
            )
            return 0
        hits = 0
        for present in found:
            if not present:
                break
            hits += 1
        return hits

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        rng = block_range(
            pending.num_computed_tokens, num_external_tokens, self.engine_info.block_size
        )
        keys = pending.keys[: len(rng)]
        error = pending.error
        if error is None and (len(keys) < len(rng) or rng.stop > len(block_ids)):
            error = f"{len(rng)} blocks to load but {len(keys)} hashes and {len(block_ids)} blocks"
        bounded_put(self._loaded_blocks, request.request_id, rng.stop)
        self._meta.loads.append(
            StoreLoad(
                request_id=request.request_id,
                block_ids=list(block_ids[rng.start : rng.stop]),
                keys=keys,
                wait=pending.wait,
                error=error,
            )
        )

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, RedisMetadata()
        return meta

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._pending.pop(rid, None)
        stored = self._loaded_blocks.pop(rid, 0)
        params = request.kv_transfer_params or {}
        if not self.is_producer:
            return False, None
        bs = self.engine_info.block_size
        num_full = min(len(request.block_hashes), request.num_computed_tokens // bs, len(block_ids))
        if num_full > stored:
            self._meta.saves.append(
                StoreSave(
                    request_id=rid,
                    block_ids=list(block_ids[stored:num_full]),
                    keys=[self.key(h) for h in request.block_hashes[stored:num_full]],
                )
            )
        out = None
        if params.get("do_remote_decode"):
            num_prompt_blocks = min(num_full, request.num_prompt_tokens // bs)
            out = {
                "do_remote_prefill": True,
                "connector": self.config.connector,
                "remote_engine_id": self.engine_info.engine_id,
                "remote_request_id": rid,
                "num_tokens": num_prompt_blocks * bs,
                "block_hashes": [h.hex() for h in request.block_hashes[:num_prompt_blocks]],
            }
        return num_full > stored, out

    # ============================================================ worker side
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        info = self.engine_info
        self.blocks = block_bytes(kv_cache, info.num_blocks, info.block_nbytes)
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

    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        with self._lock:
            out = (self._done_sending, self._done_recving, self._failed)
            self._done_sending, self._done_recving, self._failed = set(), set(), {}
        return out

    def shutdown(self) -> None:
        self._loads.put(None)
        self._saves.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    # ------------------------------------------------------------ background threads
    def _chunks(self, n: int) -> list[range]:
        per = max(1, self.options.max_pipeline_bytes // self.engine_info.block_nbytes)
        return [range(i, min(i + per, n)) for i in range(0, n, per)]

    def _load_loop(self) -> None:
        fetch = self._fetcher()
        while (load := self._loads.get()) is not None:
            started = time.monotonic()
            try:
                error = load.error or self._load(fetch, load)
            except Exception as e:  # redis errors, and anything unexpected: never hang
                error = f"Redis load failed: {type(e).__name__}: {e}"
            with self._lock:
                if error is None:
                    self._done_recving.add(load.request_id)
                else:
                    self._failed[load.request_id] = error
            n = len(load.block_ids)
            if error is None:
                self.stats.record(
                    time.monotonic() - started, n * self.engine_info.block_nbytes, n, loaded=True
                )
            else:
                self.stats.num_failed_transfers += 1
                logger.warning("%s: KV load failed: %s", load.request_id, error)
        fetch(None, [])  # close

    def _fetcher(self) -> Any:
        """fetch(keys, sinks) -> per key None | header bytes | problem str (payload in sink)."""
        try:
            reader = BlockReader(self.options.url, self.options.timeout_s)
        except ValueError:  # TLS and other URLs: redis-py parses, one more copy
            reader = None
        client = self._client(self.options.timeout_s)

        def fetch(keys: list[str] | None, sinks: list[memoryview]) -> list[Any]:
            if keys is None:
                if reader is not None:
                    reader.close()
                client.close()
                return []
            if reader is not None:
                return reader.get_into(keys, _HEADER.size, sinks)
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            out: list[Any] = []
            for value, sink in zip(pipe.execute(), sinks, strict=True):
                if value is None or len(value) != _HEADER.size + len(sink):
                    out.append(
                        None
                        if value is None
                        else f"stored value is {len(value)} bytes, "
                        f"expected {_HEADER.size + len(sink)}"
                    )
                    continue
                sink[:] = memoryview(value)[_HEADER.size :]
                out.append(bytes(value[: _HEADER.size]))
            return out

        return fetch

    def _load(self, fetch: Any, load: StoreLoad) -> str | None:
        blocks = self.blocks
        assert blocks is not None
        nbytes = self.engine_info.block_nbytes
        on_cpu = blocks.device.type == "cpu"
        deadline = time.monotonic() + (self.options.wait_s if load.wait else 0.0)
        missing = list(range(len(load.keys)))
        while True:
            still = []
            for chunk in self._chunks(len(missing)):
                idx = [missing[i] for i in chunk]
                # CPU: payloads land in the KV blocks themselves; CUDA: through host buffers.
                sinks = [
                    memoryview(blocks[load.block_ids[i]].numpy())
                    if on_cpu
                    else memoryview(bytearray(nbytes))
                    for i in idx
                ]
                for i, head, sink in zip(
                    idx, fetch([load.keys[i] for i in idx], sinks), sinks, strict=True
                ):
                    if head is None:
                        still.append(i)
                        continue
                    problem = head if isinstance(head, str) else self._check(head, sink)
                    if problem is not None:
                        return f"block {i} ({load.keys[i]}): {problem}"
                    if not on_cpu:
                        import torch

                        blocks[load.block_ids[i]].copy_(torch.frombuffer(sink, dtype=torch.uint8))
            missing = still
            if not missing:
                return None
            if time.monotonic() >= deadline:
                return (
                    f"store miss: {len(missing)} of {len(load.keys)} blocks not in Redis "
                    f"(first: {load.keys[missing[0]]})"
                )
            time.sleep(0.02)

    def _check(self, head: bytes, payload: memoryview) -> str | None:
        magic, flags, checksum = _HEADER.unpack(head)
        if magic != _MAGIC:
            return "stored value is not a splitserve KV block"
        if self.config.verify:
            if not flags & _HAS_CHECKSUM:
                return "verify is on but the block was stored without a checksum"
            if xxhash.xxh64_intdigest(payload) != checksum:
                return "checksum mismatch"
        return None

    def _save_loop(self) -> None:
        client = self._client(self.options.timeout_s)
        while (save := self._saves.get()) is not None:
            started = time.monotonic()
            try:
                self._save(client, save)
                n = len(save.block_ids)
                self.stats.record(
                    time.monotonic() - started, n * self.engine_info.block_nbytes, n, loaded=False
                )
            except Exception as e:
                self.stats.num_failed_transfers += 1
                logger.warning(
                    "%s: KV save to Redis failed: %s: %s", save.request_id, type(e).__name__, e
                )
            with self._lock:
                self._done_sending.add(save.request_id)  # the blocks may be freed either way
        client.close()

    def _save(self, client: redis.Redis, save: StoreSave) -> None:
        blocks = self.blocks
        assert blocks is not None
        ttl = self.options.ttl_s
        px = int(ttl * 1000) if ttl is not None else None
        for chunk in self._chunks(len(save.block_ids)):
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                row = blocks[save.block_ids[i]]
                payload = memoryview((row if row.device.type == "cpu" else row.cpu()).numpy())
                flags, checksum = 0, 0
                if self.config.verify:
                    flags, checksum = _HAS_CHECKSUM, xxhash.xxh64_intdigest(payload)
                value = b"".join((_HEADER.pack(_MAGIC, flags, checksum), payload))
                pipe.set(save.keys[i], value, px=px)
            pipe.execute()
