"""KV blocks, reference counts, the free-block queue and the hash → block map.

Design notes
------------
A block is *free* when no running request references it (`ref_cnt == 0`). A free block may still
hold a valid prefix: its hash stays in `cached_blocks` until the block is handed out again, so a
later request with the same prefix can revive it (`touch`). Eviction is therefore implicit: taking
a block from the head of the free queue evicts whatever it cached.

Why a hand-written doubly linked list and not a `deque`: reviving a cached block removes it from
the *middle* of the free queue, which must be O(1). Freed blocks are appended at the tail (a request
frees its blocks tail-first), so the head holds the least recently used blocks, and the last blocks
of a prompt — the least likely to be shared — are evicted before its first ones.

Block hashes chain: `h_i = H(h_{i-1}, tokens of block i, extra_keys)` with blake2b, so a hash names
the whole prefix up to and including its block, and it is the same in every process and on every
host (Python's `hash()` is salted per process). The shared store and prefix-aware routing rely on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

_HASH_BYTES = 16


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """Stable chained hash of one full block."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(parent or b"\x00" * _HASH_BYTES)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(extra_keys)
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, existing: list[bytes]) -> None:
    """Extend `existing` with the hashes of every full block of `token_ids` not yet hashed."""
    for i in range(len(existing), len(token_ids) // block_size):
        parent = existing[-1] if existing else None
        existing.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) `popleft`, `append` and `remove`."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not in queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Queue order, head first (tests and debugging)."""
        ids, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every KV block of an instance."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        # Prefix-cache statistics (queries and hits in tokens), read by metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the LRU end, evicting what they cached; each gets ref_cnt 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash; the first block with a hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return  # same content computed twice concurrently; keep the first copy
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
