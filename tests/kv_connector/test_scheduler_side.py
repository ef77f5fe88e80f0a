"""The scheduler half of each connector: kv_transfer_params in, typed metadata out.

No worker, no transport: this half never touches the KV cache or the network (except the
redis lookup, tested against a real server).
"""

from __future__ import annotations

import msgspec
import pytest
from kvc_helpers import RedisServer

from splitserve.kv_connector.base import EngineInfo, KVConnectorRole
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.driver import SimRequest, chain_block_hashes
from splitserve.kv_connector.p2p import P2PMetadata
from splitserve.kv_connector.redis.connector import RedisMetadata
from splitserve.kv_connector.registry import create_connector

BS = 16
INFO = EngineInfo(
    engine_id="eng",
    block_size=BS,
    num_blocks=64,
    block_nbytes=4096,
    model_fingerprint="fp",
    device="cpu",
)


def _scheduler(connector: str, role: str = "both", **kwargs: object):
    config = KVTransferConfig(connector=connector, kv_role=role, side_channel_port=5599, **kwargs)
    return create_connector(config, KVConnectorRole.SCHEDULER, INFO)


def _request(rid: str, n: int, params: dict | None = None, computed: int = 0) -> SimRequest:
    tokens = list(range(100, 100 + n))
    return SimRequest(
        rid,
        tokens,
        params,
        num_computed_tokens=computed,
        all_token_ids=list(tokens),
        block_hashes=chain_block_hashes(tokens, BS),
    )


def _remote(num_tokens: int, blocks: list[int], connector: str = "nixl") -> dict:
    return {
        "do_remote_prefill": True,
        "connector": connector,
        "remote_engine_id": "p0",
        "remote_host": "127.0.0.1",
        "remote_port": 7000,
        "remote_block_ids": blocks,
        "remote_request_id": "p-r",
        "num_tokens": num_tokens,
        "lease_s": 30,
    }


@pytest.mark.parametrize("connector", ["nixl", "nccl"])
def test_producer_holds_and_returns_params(connector: str) -> None:
    s = _scheduler(connector, "producer", lease_s=20)
    req = _request("r1", 50, {"do_remote_decode": True, "lease_s": 90}, computed=50)
    req.all_token_ids.append(7)  # t0
    delay, params = s.request_finished(req, [9, 4, 6, 1, 30])
    assert delay is True
    assert params == {
        "do_remote_prefill": True,
        "connector": connector,
        "remote_engine_id": "eng",
        "remote_host": "127.0.0.1",
        "remote_port": 5599,
        "remote_block_ids": [9, 4, 6, 1],
        "remote_request_id": "r1",
        "num_tokens": 50,
        "lease_s": 20.0,
    }
    meta = s.build_connector_meta()
    assert isinstance(meta, P2PMetadata) and [h.block_ids for h in meta.holds] == [[9, 4, 6, 1]]
    assert s.build_connector_meta().holds == []  # drained
    # A shorter lease asked by the router wins; a request without do_remote_decode is not held.
    req2 = _request("r2", 20, {"do_remote_decode": True, "lease_s": 2}, computed=20)
    assert s.request_finished(req2, [1, 2])[1]["lease_s"] == 2.0
    assert s.request_finished(_request("r3", 20, None, computed=20), [3, 5]) == (False, None)
    # Aborted before its prompt was computed: nothing to hold.
    assert s.request_finished(_request("r4", 20, {"do_remote_decode": True}), [3]) == (False, None)


def test_consumer_only_never_holds() -> None:
    s = _scheduler("nixl", "consumer")
    req = _request("r1", 40, {"do_remote_decode": True}, computed=40)
    assert s.request_finished(req, [1, 2, 3]) == (False, None)


def test_consumer_maps_remote_blocks_onto_its_own() -> None:
    s = _scheduler("nixl", "consumer")
    # The decode request: the 50 prompt tokens + t0. Local prefix hit: the first block.
    req = _request("d1", 51, _remote(50, [40, 41, 42, 43]))
    num, is_async = s.get_num_new_matched_tokens(req, 16)
    assert (num, is_async) == (34, True)  # tokens 16..49; t0 is computed locally
    s.update_state_after_alloc(req, [5, 6, 7, 8], num)
    (load,) = s.build_connector_meta().loads
    assert load.error is None
    assert (load.block_offset, load.remote_block_ids, load.local_block_ids) == (
        1,
        [41, 42, 43],
        [6, 7, 8],
    )
    assert (load.remote_request_id, load.remote_host, load.remote_port) == (
        "p-r",
        "127.0.0.1",
        7000,
    )
    msgspec.msgpack.decode(msgspec.msgpack.encode(load), type=type(load))  # a wire-able message


def test_consumer_full_local_hit_releases_the_producer() -> None:
    s = _scheduler("nccl", "consumer")
    req = _request("d1", 33, _remote(32, [1, 2], connector="nccl"), computed=0)
    assert s.get_num_new_matched_tokens(req, 32) == (0, False)
    meta = s.build_connector_meta()
    assert not meta.loads and [r.remote_request_id for r in meta.releases] == ["p-r"]


def test_bad_params_fail_through_the_worker() -> None:
    """Unusable kv_transfer_params become a load with an error, so the failure policy applies."""
    s = _scheduler("nixl", "consumer")
    for params, expect in [
        ({"do_remote_prefill": True, "remote_host": "h"}, "invalid kv_transfer_params"),
        (_remote(50, [1, 2, 3, 4], connector="redis"), "connector 'redis'"),
        (_remote(50, [1, 2]), "2 remote blocks cannot hold 50 tokens"),
    ]:
        req = _request("d", 51, params)
        num, is_async = s.get_num_new_matched_tokens(req, 0)
        assert (num, is_async) == (50, True)
        s.update_state_after_alloc(req, [1, 2, 3, 4], num)
        (load,) = s.build_connector_meta().loads
        assert expect in (load.error or ""), load


def test_requests_without_params_are_not_ours() -> None:
    s = _scheduler("nixl")
    req = _request("d", 40)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, [1, 2, 3], 0)
    assert s.build_connector_meta() == P2PMetadata()


def test_redis_lookup_counts_leading_stored_blocks(redis_server: RedisServer) -> None:
    s = _scheduler("redis", options={"url": redis_server.url, "key_prefix": "t-lookup"})
    req = _request("d1", 70)
    client = redis_server.client()
    for h in req.block_hashes[:2] + req.block_hashes[3:4]:  # blocks 0, 1 and 3 (not 2)
        client.set(s.key(h), b"x")
    client.close()
    assert s.get_num_new_matched_tokens(req, 0) == (32, True)
    assert s.get_num_new_matched_tokens(req, 16) == (16, True)
    s.update_state_after_alloc(req, [10, 11, 12, 13, 14], 16)
    (load,) = s.build_connector_meta().loads
    assert load.block_ids == [11] and load.keys == [s.key(req.block_hashes[1])]
    assert load.wait is False


def test_redis_unreachable_lookup_is_a_miss() -> None:
    s = _scheduler("redis", options={"url": "redis://127.0.0.1:1/0", "lookup_timeout_s": 0.2})
    assert s.get_num_new_matched_tokens(_request("d1", 70), 0) == (0, False)


def test_redis_producer_saves_full_blocks_and_answers_pd() -> None:
    s = _scheduler("redis", "producer", options={"key_prefix": "t"})
    req = _request("p1", 50, {"do_remote_decode": True}, computed=50)
    req.all_token_ids.append(7)
    delay, params = s.request_finished(req, [4, 5, 6, 7])
    assert delay is True  # held until the write lands
    assert params["num_tokens"] == 48 and params["connector"] == "redis"
    assert params["block_hashes"] == [h.hex() for h in req.block_hashes[:3]]
    meta = s.build_connector_meta()
    assert isinstance(meta, RedisMetadata)
    (save,) = meta.saves
    assert save.block_ids == [4, 5, 6] and save.keys[0].startswith("t:fp:")


def test_redis_consumer_rejects_foreign_hashes() -> None:
    s = _scheduler("redis", "consumer")
    req = _request(
        "d1",
        49,
        {
            "do_remote_prefill": True,
            "connector": "redis",
            "num_tokens": 48,
            "block_hashes": ["00" * 16],
        },
    )
    num, is_async = s.get_num_new_matched_tokens(req, 0)
    assert (num, is_async) == (48, True)
    s.update_state_after_alloc(req, [1, 2, 3, 4], num)
    (load,) = s.build_connector_meta().loads
    assert "block hashes differ" in (load.error or "")
