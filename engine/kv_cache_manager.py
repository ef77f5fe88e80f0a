"""Per-request KV block allocation on top of the BlockPool, with prefix caching."""

from __future__ import annotations

from splitserve.engine.block_pool import BlockPool, KVCacheBlock, hash_request_blocks
from splitserve.engine.request import Request
from splitserve.kv_connector.layout import cdiv


class KVCacheManager:
    """Maps each request to its ordered block list; finds prefix hits; frees.

    A request's blocks cover its tokens in order: token `t` lives in block `t // block_size` of
    the list, at offset `t % block_size`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already hashed in
        self.req_to_block_ids: dict[str, list[int]] = {}  # the same, as ids (read-only outside)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def update_block_hashes(self, request: Request) -> None:
        hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request.

        At least one token is always left to compute: the model must run on the last token to
        produce logits, so a prompt that is entirely cached still recomputes its last token.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.block_pool.prefix_queries += request.num_tokens
        self.block_pool.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_external_tokens: int = 0,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`; None if blocks ran out.

        ```
        | computed (cached or earlier steps) | prefix hits | external (KV loaded) | new tokens |
        |<-------- request.num_computed_tokens ------------>|
        ```
        (`request.num_computed_tokens` already includes the prefix hits passed in
        `new_computed_blocks`.) Full blocks get their hash registered at once, unless
        `delay_caching`: blocks that a KV transfer will fill must not be shared before they land.
        """
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is not None and not new_computed_blocks and not num_external_tokens:
            # Fast path, taken by almost every decode step: the last block still has room.
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(req_blocks) * self.block_size:
                if (self.enable_caching and not delay_caching
                        and total // self.block_size > self.num_cached_blocks.get(rid, 0)):
                    self.cache_blocks(request, min(total, request.num_tokens))
                return []
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(rid, [])
        total = request.num_computed_tokens + num_external_tokens + num_new_tokens
        num_new = cdiv(total, self.block_size) - len(req_blocks) - len(new_computed_blocks)
        # Hits that are free right now count against the free pool once we take them.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > self.block_pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[rid]
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new, 0))
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        ids = self.req_to_block_ids.setdefault(rid, [])
        ids.extend(b.block_id for b in new_computed_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching and not delay_caching:
            self.cache_blocks(request, min(total, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks covering its first `num_tokens` tokens."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its prompt head is evicted last)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table; a live list the caller must not modify."""
        return self.req_to_block_ids.get(request_id, [])

    def usage(self) -> float:
        return self.block_pool.usage()

    def prefix_cache_hit_rate(self) -> float:
        pool = self.block_pool
        return pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0
