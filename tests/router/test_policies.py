"""Routing policies and the fleet config schema, without processes."""

from __future__ import annotations

import pytest

from splitserve.engine.fleet import deep_merge, parse_fleet
from splitserve.router.policies import (
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    make_policy,
    prompt_chunk_hashes,
)
from splitserve.router.registry import Instance


def insts(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)]


def test_round_robin_cycles():
    pool, rr = insts(3), RoundRobin()
    assert [rr.choose(pool).url for _ in range(6)] == [i.url for i in pool] * 2


def test_least_loaded_prefers_fewest_requests_then_free_blocks():
    pool = insts(3)
    pool[0].running, pool[1].waiting, pool[2].in_flight = 3, 1, 2
    assert LeastLoaded().choose(pool) is pool[1]
    for i in pool:
        i.running = i.waiting = i.in_flight = 0
    pool[2].kv_blocks_free = 100
    assert LeastLoaded().choose(pool) is pool[2]


def test_prefix_aware_sticks_to_the_instance_holding_the_prefix():
    pool, policy = insts(3), PrefixAware()
    long_prompt = "shared system prompt " * 40
    first = policy.choose(pool, long_prompt)
    policy.served(first, long_prompt)
    first.in_flight = 2  # busier, but within max_imbalance: the cache hit wins
    assert policy.choose(pool, long_prompt + " and a new question") is first
    first.in_flight = 50  # far busier: load wins
    assert policy.choose(pool, long_prompt) is not first


def test_prefix_aware_without_history_is_least_loaded():
    pool = insts(2)
    pool[0].in_flight = 1
    assert PrefixAware().choose(pool, "x" * 500) is pool[1]


def test_chunk_hashes_are_chained_and_token_aware():
    a = prompt_chunk_hashes("a" * 64 + "b" * 64)
    b = prompt_chunk_hashes("c" * 64 + "b" * 64)
    assert len(a) == 2 and a[1] != b[1]  # same chunk, different prefix
    assert len(prompt_chunk_hashes(list(range(40)))) == 2  # 16-token chunks
    assert prompt_chunk_hashes("short") == []


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")


BASE = {"model": "models/tiny-llama", "engine": {"num_threads": 1, "cache": {"block_size": 16}},
        "kv_transfer": {"connector": "nixl", "lease_s": 30},
        "prefill": {"count": 2, "base_port": 8100, "engine": {"cache": {"num_blocks": 64}}},
        "decode": {"count": 1, "base_port": 8200}}


def test_fleet_instance_configs_merge_roles():
    fleet = parse_fleet(BASE)
    assert [u for *_, u in fleet.instances()] == [
        "http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8200"]
    p1 = fleet.instance_data("prefill", 1)
    assert p1["server"] == {"host": "127.0.0.1", "port": 8101, "role": "prefill"}
    assert p1["engine"]["cache"] == {"block_size": 16, "num_blocks": 64}  # deep-merged
    assert p1["engine"]["kv_transfer"]["kv_role"] == "producer"
    assert p1["engine"]["model"] == {"model": "models/tiny-llama"}
    d0 = fleet.instance_data("decode", 0)
    assert d0["engine"]["kv_transfer"]["kv_role"] == "consumer"
    assert "num_blocks" not in d0["engine"]["cache"]


@pytest.mark.parametrize("change, message", [
    ({"prefill": {"count": 0}}, "prefill.count: must be >= 1"),
    ({"decode": {"count": 0}}, "decode.count: must be >= 1"),
    ({"router": {"prefill_policy": "random"}}, "router.prefill_policy"),
    ({"router": {"colour": 1}}, "router.colour"),
    ({"decode": {"base_port": 8101}}, "ports overlap"),
    ({"prefill": {"count": -1}}, "prefill.count"),
    ({"surprise": 1}, "surprise"),
])
def test_fleet_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        parse_fleet(deep_merge(BASE, change))


def test_index_out_of_range():
    with pytest.raises(ValueError, match="--index"):
        parse_fleet(BASE).instance_data("decode", 1)


def test_shipped_configs_are_valid():
    from pathlib import Path

    from splitserve.engine.fleet import load_fleet

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert {c.stem for c in configs} >= {"colocated", "1p1d-nixl", "1p1d-nccl", "1p1d-redis",
                                         "2p2d-nixl", "2p1d-redis"}
    for path in configs:
        fleet = load_fleet(path)
        assert fleet.instances()
