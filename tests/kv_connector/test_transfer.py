"""Real transfers between a producer and a consumer in two processes, for every connector.

Each side is a `SimEngine` in a spawned process driving both roles of the connector exactly as
the engine does; blocks are random (never zero) and land in different block ids on the consumer.
Faults are real too: leases that end, corrupted bytes with verify on, a producer killed with
SIGKILL, a Redis server stopped. Every wait has a timeout; every held block must come back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kvc_helpers import RedisServer, nixl_missing

from splitserve.kv_connector.driver import PRESETS, sim_kv_cache
from splitserve.kv_connector.remote_engine import RemoteEngine

SHAPE = PRESETS["tiny"]  # 4 layers, 4 kv heads, head_dim 32, block 16: 64 KiB blocks (fp32)
BS = SHAPE.block_size
NUM_BLOCKS = 96
TIMEOUT_S = 3.0  # connector timeout_s: the longest any fault may take to surface
P_SEED, D_SEED = 1, 2
CONNECTORS = ["nixl", "nccl", "redis"]


def _config(connector: str, role: str, redis: RedisServer | None, **extra: object) -> dict:
    options: dict = {"timeout_s": TIMEOUT_S}
    if connector == "redis":
        assert redis is not None
        options = {"url": redis.url, "timeout_s": TIMEOUT_S, "wait_s": 1.0, "ttl_s": 600}
    return {
        "connector": connector,
        "kv_role": role,
        "verify": True,
        "lease_s": 30,
        "options": options,
        **extra,
    }


def _start_pair(
    connector: str,
    redis: RedisServer | None,
    num_blocks: int = NUM_BLOCKS,
    step_interval_s: float = 0.001,
) -> tuple[RemoteEngine, RemoteEngine]:
    if connector == "nixl" and (why := nixl_missing()):
        pytest.skip(why)
    p = RemoteEngine(
        _config(connector, "producer", redis),
        SHAPE,
        num_blocks,
        "prefill-0",
        seed=P_SEED,
        wait=False,
        step_interval_s=step_interval_s,
    )
    d = RemoteEngine(
        _config(connector, "consumer", redis),
        SHAPE,
        num_blocks,
        "decode-0",
        seed=D_SEED,
        wait=False,
        step_interval_s=step_interval_s,
    )
    try:
        p.ready()
        d.ready()
    except BaseException:
        p.close()
        d.close()
        raise
    return p, d


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(request: pytest.FixtureRequest) -> Iterator[tuple[str, RemoteEngine, RemoteEngine]]:
    connector = request.param
    redis = request.getfixturevalue("redis_server") if connector == "redis" else None
    p, d = _start_pair(connector, redis)
    yield connector, p, d
    p.close()
    d.close()


_counter = iter(range(10**6))


def _prompt(n: int) -> list[int]:
    """A prompt no other test uses (so no cached blocks are shared by accident)."""
    base = next(_counter) * 1000 + 7
    return [base + i for i in range(n)]


def _wait_loaded(d: RemoteEngine, rids: list[str], timeout: float = 20) -> dict:
    status = d.wait_for(
        lambda s: all(r in s["done_recving"] or r in s["failed"] for r in rids), timeout
    )
    missing = [r for r in rids if r not in status["done_recving"] and r not in status["failed"]]
    assert not missing, f"loads never reported (hang): {missing}; status {status}"
    return status


def _wait_released(p: RemoteEngine, rids: list[str], timeout: float = 20) -> dict:
    status = p.wait_for(lambda s: all(r in s["done_sending"] for r in rids), timeout)
    assert all(r in status["done_sending"] for r in rids), f"blocks still held: {status}"
    return status


def _loaded_blocks(
    connector: str, p_blocks: list[int], d_blocks: list[int], num_local: int, num_tokens: int
) -> tuple[list[int], list[int]]:
    """(producer blocks, consumer blocks) that the load moved."""
    first = num_local // BS
    last = -(-num_tokens // BS) if connector != "redis" else num_tokens // BS
    return p_blocks[first:last], d_blocks[first:last]


def test_blocks_move_byte_for_byte(pd: tuple[str, RemoteEngine, RemoteEngine]) -> None:
    connector, p, d = pd
    cases = [("a", 50, 0), ("b", 37, 0), ("c", 80, 16)]  # (id, prompt tokens, local prefix hit)
    sent = {}
    for rid, n, num_local in cases:
        prompt = _prompt(n)
        out = p.call("prefill", f"p-{rid}", prompt, {"do_remote_decode": True})
        params = out["params"]
        assert params["do_remote_prefill"] is True and params["connector"] == connector
        assert params["remote_request_id"] == f"p-{rid}"
        if connector != "redis":
            assert params["remote_block_ids"] == out["block_ids"]
            assert params["num_tokens"] == n
            assert params["remote_port"] > 0
        num = d.call("load", f"d-{rid}", prompt + [1], params, num_local)
        expected = (n if connector != "redis" else n // BS * BS) - num_local
        assert num == expected, (rid, num, expected)
        sent[rid] = (out["block_ids"], num_local, n)
    status = _wait_loaded(d, [f"d-{rid}" for rid, _, _ in cases])
    assert not status["failed"], status["failed"]
    for rid, (p_blocks, num_local, n) in sent.items():
        d_blocks = d.call("block_ids", f"d-{rid}")
        src, dst = _loaded_blocks(connector, p_blocks, d_blocks, num_local, n)
        assert src and src != dst
        assert p.call("block_data", src) == d.call("block_data", dst), f"bytes differ for {rid}"
        # Blocks of the local prefix hit were not overwritten.
        keep = d_blocks[: num_local // BS]
        if keep:
            fresh = sim_kv_cache(SHAPE, NUM_BLOCKS, D_SEED).reshape(NUM_BLOCKS, -1)
            assert d.call("block_data", keep) == fresh[keep].numpy().tobytes()
    _wait_released(p, [f"p-{rid}" for rid, _, _ in cases])
    for rid, _, _ in cases:
        d.call("finish", f"d-{rid}")
    assert p.call("status")["num_free"] == NUM_BLOCKS
    assert d.wait_for(lambda s: s["num_free"] == NUM_BLOCKS, 5)["num_free"] == NUM_BLOCKS
    stats = d.call("status")["stats"]
    assert stats["blocks_loaded"] >= 3 and stats["num_failed_transfers"] == 0


def test_redis_is_a_cross_instance_prefix_cache(redis_server: RedisServer) -> None:
    """No P/D at all: one instance stores a finished prompt, another finds it by content."""
    a = RemoteEngine(
        _config("redis", "both", redis_server), SHAPE, NUM_BLOCKS, "inst-a", seed=P_SEED, wait=False
    )
    b = RemoteEngine(
        _config("redis", "both", redis_server), SHAPE, NUM_BLOCKS, "inst-b", seed=D_SEED, wait=False
    )
    try:
        a.ready()
        b.ready()
        prompt = _prompt(70)
        out = a.call("prefill", "a-1", prompt)
        assert out["params"] is None  # not a P/D request: nothing for the client
        _wait_released(a, ["a-1"])  # the save landed
        num = b.call("load", "b-1", prompt + [5, 6], None)
        assert num == 64  # four full blocks of the 70-token prompt
        assert not _wait_loaded(b, ["b-1"])["failed"]
        src = out["block_ids"][:4]
        dst = b.call("block_ids", "b-1")[:4]
        assert a.call("block_data", src) == b.call("block_data", dst)
        assert b.call("load", "b-2", _prompt(70), None) == 0  # unknown content: a miss
    finally:
        a.close()
        b.close()


def test_late_consumer_fails_cleanly(pd, request: pytest.FixtureRequest) -> None:
    """The KV is gone before the consumer comes: nixl/nccl leases end (the producer frees the
    blocks and counts it), redis blocks are evicted. The load fails with the reason."""
    connector, p, d = pd
    prompt = _prompt(40)
    out = p.call("prefill", "p-late", prompt, {"do_remote_decode": True, "lease_s": 0.3})
    before = p.call("status")["stats"]["expired_leases"]
    status = _wait_released(p, ["p-late"], timeout=10)
    assert status["num_free"] == NUM_BLOCKS
    if connector == "redis":
        client = request.getfixturevalue("redis_server").client()
        assert client.delete(*p.call("store_keys", prompt)) == 2  # evicted
        client.close()
        expect = "store miss"
    else:
        assert out["params"]["lease_s"] == 0.3  # the router's shorter lease wins
        assert status["stats"]["expired_leases"] == before + 1
        expect = "lease expired"
    d.call("load", "d-late", prompt + [1], out["params"])
    status = _wait_loaded(d, ["d-late"])
    assert expect in status["failed"].get("d-late", ""), status


def test_corrupted_block_fails_with_verify(pd, request: pytest.FixtureRequest) -> None:
    connector, p, d = pd
    prompt = _prompt(64)
    out = p.call("prefill", "p-bad", prompt, {"do_remote_decode": True})
    if connector == "redis":
        _wait_released(p, ["p-bad"])  # stored; now flip bytes inside one stored value
        client = request.getfixturevalue("redis_server").client()
        key = p.call("store_keys", prompt)[2]
        client.setrange(key, 1000, b"\x00\x01\x02\x03")
        client.close()
    else:
        # The producer took its checksums when the hold began (the step after prefill, before
        # this call is served); now its memory changes under the lease.
        p.call("corrupt", out["block_ids"][2])
    d.call("load", "d-bad", prompt + [1], out["params"])
    status = _wait_loaded(d, ["d-bad"])
    assert "checksum mismatch in block 2" in status["failed"].get("d-bad", "") or (
        connector == "redis" and "checksum mismatch" in status["failed"].get("d-bad", "")
    ), status
    _wait_released(p, ["p-bad"])
    assert p.call("status")["num_free"] == NUM_BLOCKS


@pytest.mark.parametrize("connector", ["nixl", "nccl"])
def test_killed_producer_fails_loads(connector: str) -> None:
    """A producer SIGKILLed with a warm connection: the next load fails fast, never hangs,
    and one started while it dies (a large load) fails or lands intact — never garbage."""
    p, d = _start_pair(connector, None, num_blocks=1100)
    try:
        warm = _prompt(32)
        out = p.call("prefill", "p-warm", warm, {"do_remote_decode": True})
        d.call("load", "d-warm", warm + [1], out["params"])
        assert not _wait_loaded(d, ["d-warm"])["failed"]
        big = [7] * (1000 * BS)  # 1000 blocks, 64 MiB: the kill lands while it moves
        big_out = p.call("prefill", "p-big", big, {"do_remote_decode": True})
        late = _prompt(40)
        late_out = p.call("prefill", "p-late", late, {"do_remote_decode": True})
        d.call("load", "d-big", big + [1], big_out["params"])
        time.sleep(0.005 if connector == "nixl" else 0.015)  # let the transfer get going
        p.kill()
        started = time.monotonic()
        d.call("load", "d-late", late + [1], late_out["params"])
        status = _wait_loaded(d, ["d-big", "d-late"], timeout=4 * TIMEOUT_S + 10)
        assert time.monotonic() - started < 3 * TIMEOUT_S + 5
        assert "d-late" in status["failed"], status
        print(
            f"after kill ({time.monotonic() - started:.2f}s):",
            status["failed"],
            sorted(status["done_recving"]),
        )
        if "d-big" in status["done_recving"]:  # it finished before the kill: bytes must be right
            expected = sim_kv_cache(SHAPE, 1100, P_SEED)
            src = big_out["block_ids"]
            dst = d.call("block_ids", "d-big")[: len(src)]
            want = expected.reshape(expected.shape[0], -1)[src].numpy().tobytes()
            assert d.call("block_data", dst, timeout=60) == want
    finally:
        p.close()
        d.close()


def test_redis_stopped_fails_loads_and_releases_saves(own_redis_server: RedisServer) -> None:
    p, d = _start_pair("redis", own_redis_server)
    try:
        prompt = _prompt(48)
        out = p.call("prefill", "p-1", prompt, {"do_remote_decode": True})
        _wait_released(p, ["p-1"])
        own_redis_server.stop()
        # Loads: the stored blocks are gone with the server; the request fails, fast.
        d.call("load", "d-1", prompt + [1], out["params"])
        status = _wait_loaded(d, ["d-1"], timeout=3 * TIMEOUT_S)
        assert "Redis" in status["failed"].get("d-1", "") or "store" in status["failed"]["d-1"]
        # Lookups: a dead store is a miss, not an error and not a wait.
        started = time.monotonic()
        assert d.call("load", "d-2", _prompt(48) + [1], None) == 0
        assert time.monotonic() - started < 3
        # Saves: the write fails, and the held blocks are released anyway.
        p.call("prefill", "p-2", _prompt(48), {"do_remote_decode": True})
        status = _wait_released(p, ["p-2"], timeout=3 * TIMEOUT_S)
        assert status["stats"]["num_failed_transfers"] >= 1
        assert status["num_free"] == NUM_BLOCKS
    finally:
        p.close()
        d.close()
