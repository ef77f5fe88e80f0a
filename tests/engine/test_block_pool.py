"""BlockPool and free-block queue, without a model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.engine.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_request_blocks,
)


def test_free_queue_remove_from_middle_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert q.num_free_blocks == 4
    q.append(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4, 2]
    assert q.popleft().block_id == 0
    assert q.num_free_blocks == 4


def test_allocate_and_free_counts():
    pool = BlockPool(8)
    got = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 5
    with pytest.raises(ValueError, match="asked for 6 blocks, 5 free"):
        pool.get_new_blocks(6)
    pool.free_blocks(got)
    assert pool.num_free_blocks == 8
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks(got[:1])


def test_eviction_is_lru_and_drops_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h-a" * 6)
    pool.cache_full_block(b, b"h-b" * 6)
    pool.free_blocks([b, a])  # freed tail-first: b is older in the queue than a
    # Blocks 2 and 3 were never used; they go first, then b, then a.
    order = [blk.block_id for blk in pool.get_new_blocks(3)]
    assert order == [2, 3, b.block_id]
    assert pool.get_cached_block(b"h-b" * 6) is None  # evicted by reuse
    assert pool.get_cached_block(b"h-a" * 6) is a  # still cached while free


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"x" * 16)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, a])
    assert pool.num_free_blocks == 3


def test_hash_chain_depends_on_parent_and_tokens():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    hashes: list[bytes] = []
    hash_request_blocks(list(range(10)), 4, hashes)
    assert len(hashes) == 2  # only full blocks
    hash_request_blocks(list(range(12)), 4, hashes)
    assert len(hashes) == 3 and hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_hash_is_identical_across_processes():
    code = ("from splitserve.engine.block_pool import hash_request_blocks as h; out=[]; "
            "h(list(range(100)), 16, out); print(b''.join(out).hex())")
    results = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True)
        results.add(proc.stdout.strip())
    local: list[bytes] = []
    hash_request_blocks(list(range(100)), 16, local)
    assert results == {b"".join(local).hex()}
