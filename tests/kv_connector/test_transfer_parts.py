"""The parts the connectors' data paths are built from, each on its own: the finished-results
holder, huge-page placement, gloo's message plan, and the RESP block reader/writer against a
real redis-server."""

from __future__ import annotations

import threading

import pytest
import torch
from kvc_helpers import RedisServer

from splitserve.kv_connector.base import FinishedSet
from splitserve.kv_connector.hugepages import HUGE_PAGE, empty_on_huge_pages, use_huge_pages
from splitserve.kv_connector.layout import contiguous_runs
from splitserve.kv_connector.nccl.pair import PACK_CHUNK, PIECE, Job, plan
from splitserve.kv_connector.redis.resp import RespConnection
from splitserve.kv_connector.redis.store import HEADER, BlockStore


def test_finished_set_reports_each_result_once() -> None:
    finished = FinishedSet()

    def report(i: int) -> None:
        for j in range(200):
            rid = f"r{i}-{j}"
            (finished.sent, finished.recved)[j % 2](rid)
            if j % 50 == 0:
                finished.failed(rid + "-x", "why")

    threads = [threading.Thread(target=report, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    seen: list[tuple[set[str], set[str], dict[str, str]]] = []
    while any(t.is_alive() for t in threads):
        seen.append(finished.drain())
    for t in threads:
        t.join()
    seen.append(finished.drain())
    sent = [r for s, _, _ in seen for r in s]
    recved = [r for _, r, _ in seen for r in r]
    failed = [r for _, _, f in seen for r in f]
    assert len(sent) == len(set(sent)) == 400
    assert len(recved) == len(set(recved)) == 400
    assert len(failed) == 16 and all(f["r0-0-x"] == "why" for _, _, f in seen if "r0-0-x" in f)
    assert finished.drain() == (set(), set(), {})


def test_huge_pages_keep_the_bytes() -> None:
    t = torch.rand(3 * HUGE_PAGE // 4 + 123)  # not a multiple of the huge page size
    before = t.clone()
    covered = use_huge_pages(t)
    assert covered % HUGE_PAGE == 0 and 0 <= covered <= t.numel() * 4
    assert torch.equal(t, before)
    assert use_huge_pages(torch.rand(100)) == 0  # smaller than one huge page
    buf = empty_on_huge_pages(5 * HUGE_PAGE + 7, torch.device("cpu"))
    assert buf.shape == (5 * HUGE_PAGE + 7,) and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0


@pytest.mark.parametrize("send", [True, False])
def test_gloo_plan_moves_every_block_once(send: bool) -> None:
    block = 64 << 10
    src = list(range(600)) + [900, 700, 650, 651, 800] + list(range(1000, 1100))
    dst = list(range(2000, 2600)) + [5, 3, 1, 2, 9] + [3000 + 2 * i for i in range(100)]
    runs = contiguous_runs(src, dst)
    messages = plan(Job(send, "r", runs, 1, 0.0), block)
    moved = []
    for m in messages:
        if isinstance(m, tuple):
            assert m[1] * block <= PIECE
            moved.extend(range(m[0], m[0] + m[1]))
        else:
            assert len(m) * block <= PACK_CHUNK
            moved.extend(m)
    assert moved == (src if send else dst)  # each block once, in order
    assert isinstance(messages[0], tuple) and isinstance(messages[-1], list)
    # The receiver derives the same message sizes from the same runs.
    other = plan(Job(not send, "r", runs, 1, 0.0), block)
    assert [m[1] if isinstance(m, tuple) else len(m) for m in messages] == [
        m[1] if isinstance(m, tuple) else len(m) for m in other
    ]


def test_resp_writes_and_reads_blocks_in_place(redis_server: RedisServer) -> None:
    conn = RespConnection(redis_server.url, timeout_s=5)
    try:
        blocks = torch.rand(6, 4096).view(torch.uint8)  # [6, 16 KiB]
        items = [(f"t:resp:{i}", b"H%015d" % i, memoryview(blocks[i].numpy())) for i in range(6)]
        conn.set_many(items, px=60_000, per_pipeline=4)
        out = torch.zeros_like(blocks)
        sinks = [memoryview(out[i].numpy()) for i in range(6)]
        heads = conn.get_into([k for k, _, _ in items], 16, sinks, per_pipeline=4)
        assert heads == [h for _, h, _ in items]
        assert torch.equal(out, blocks)
        client = redis_server.client()
        assert 0 < client.pttl("t:resp:0") <= 60_000
        client.set("t:resp:short", b"x" * 10)
        client.close()
        short = memoryview(bytearray(16384))
        missing, wrong = conn.get_into(["t:resp:none", "t:resp:short"], 16, [short, short], 1)
        assert missing is None and "10 bytes" in wrong
        # The stream stays in step after a miss and a wrong size.
        assert conn.get_into(["t:resp:5"], 16, [sinks[0]], 1) == [items[5][1]]
    finally:
        conn.close()


@pytest.mark.parametrize(("verify", "raw"), [(True, True), (False, True), (True, False)])
def test_block_store_round_trip_across_pipelines(
    redis_server: RedisServer, verify: bool, raw: bool
) -> None:
    """Our RESP path and redis-py's (TLS URLs) store and load the same values."""
    nbytes = 32 << 10
    blocks = torch.rand(10, nbytes // 4).view(torch.uint8)
    keys = [f"t:store:{verify}:{raw}:{i}" for i in range(7)]
    # Pipelines of two values: 7 blocks take four round trips each way.
    store = BlockStore(redis_server.url, 5, 2 * (HEADER.size + nbytes), verify, ttl_s=60, raw=raw)
    try:
        store.save(blocks, [9, 2, 4, 0, 1, 7, 5], keys)
        dest = torch.zeros_like(blocks)
        assert store.load(dest, [0, 1, 2, 3, 4, 5, 6], keys, wait_s=0) is None
        assert torch.equal(dest[:7], blocks[[9, 2, 4, 0, 1, 7, 5]])
        problem = store.load(dest, [0, 1], [keys[0], "t:store:absent"], wait_s=0)
        assert problem is not None and "store miss: 1 of 2" in problem
        other = BlockStore(redis_server.url, 5, 1 << 20, verify, ttl_s=60, raw=not raw)
        try:  # the other path reads the same values
            dest.zero_()
            assert other.load(dest, [3, 4], keys[:2], wait_s=0) is None
            assert torch.equal(dest[3:5], blocks[[9, 2]])
        finally:
            other.close()
    finally:
        store.close()
