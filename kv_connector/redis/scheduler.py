"""Scheduler side of the Redis connector: store lookups and the per-step load/save messages.

A request's full prompt blocks past its local prefix-cache hit are looked up by key (pipelined
EXISTS); the leading run of hits becomes a `StoreLoad`. A finished request's full blocks that
did not come from the store become a `StoreSave`, and for a P/D producer the kv_transfer_params
naming them by hash.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from splitserve.kv_connector.base import EngineInfo, KVConnectorMetadata, RequestView
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.layout import block_range, bounded_put
from splitserve.kv_connector.redis.store import redis_client

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

_LOOKUP_BACKOFF_S = 5


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
class PendingLookup:
    keys: list[str]  # of the blocks from num_computed_tokens on
    num_computed_tokens: int
    wait: bool
    error: str | None = None


class RedisSchedulerSide:
    """Mixin of RedisConnector: the scheduler-role methods."""

    config: KVTransferConfig
    engine_info: EngineInfo
    options: Any  # RedisOptions
    is_producer: bool
    is_consumer: bool
    _prefix: str  # of every key: "{key_prefix}:{model_fingerprint}:"
    _lookup_client: redis.Redis | None
    _lookup_down_until: float  # after a failed lookup, skip lookups until then
    _pending: dict[str, PendingLookup]
    _loaded_blocks: dict[str, int]  # request → blocks [0, n) known to be stored
    _meta: RedisMetadata

    def key(self, block_hash: bytes) -> str:
        return self._prefix + block_hash.hex()

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
        num = min((first + max(num_blocks, 0)) * bs, request.num_tokens - 1)
        num -= num_computed_tokens
        if num <= 0:
            return 0, False
        bounded_put(
            self._pending, request.request_id, PendingLookup(keys, num_computed_tokens, wait, error)
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
                self._lookup_client = redis_client(self.options.url, self.options.lookup_timeout_s)
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
