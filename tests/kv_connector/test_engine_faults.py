"""Engine-level KV transfer (issue 5) under faults: producer SIGKILLed, lease expired, Redis
stopped, a block corrupted under verify. Each must give the colocated tokens under
`failure_policy: recompute` and a clear error, never other tokens, under `fail`; every KV block
comes back on every engine (the fleet: engine_fleet.py; the kill test starts its own producer).
"""

from __future__ import annotations

import pytest
from engine_fleet import (
    COLOCATED,
    CONNECTORS,
    P2P,
    WAIT_S,
    Fleet,
    all_blocks_free,
    available,
    check_fault,
    decode,
    fresh_prompt,
    kv_config,
    prefill,
    run_both_policies,
)
from engine_peers import EngineProcess


@pytest.mark.parametrize("connector", CONNECTORS)
def test_late_consumer_after_lease(fleet: Fleet, connector: str) -> None:
    """nixl/nccl: the router's short lease ends before the consumer comes; the producer frees
    the blocks by itself. redis: the stored blocks are evicted before the consumer comes."""
    available(connector)
    p = fleet.p
    prompts = [fresh_prompt(40), fresh_prompt(40)]
    p0 = p.call("stats", connector)
    firsts = prefill(p, connector, prompts, lease_s=0.3)
    waited = p.call("wait_for_transfers", connector, WAIT_S, timeout=WAIT_S + 30)
    assert waited["ok"] is True, waited
    p1 = p.call("stats", connector)
    if connector in P2P:
        assert firsts[0]["kv_transfer_params"]["lease_s"] == 0.3  # the router's shorter lease
        assert waited["seconds"] >= 0.25, waited
        assert p1["connector"]["expired_leases"] == p0["connector"]["expired_leases"] + 2
        needles = ("lease expired",)
    else:  # saved, then evicted
        client = fleet.redis.client()
        for f in firsts:
            for h in f["kv_transfer_params"]["block_hashes"]:
                [key] = client.keys(f"*:{h}")
                assert client.delete(key) == 1
        client.close()
        needles = ("store miss",)
    all_blocks_free(p, connector)
    run_both_policies(fleet, connector, prompts, firsts, *needles)


def _corrupt_stored_block(fleet: Fleet, first: dict, index: int) -> None:
    """Flip bytes inside a stored block's value (its header and checksum stay)."""
    client = fleet.redis.client()
    [key] = client.keys(f"*:{first['kv_transfer_params']['block_hashes'][index]}")
    value = bytearray(client.get(key))
    value[1000:1004] = bytes(b ^ 0xFF for b in value[1000:1004])
    client.set(key, bytes(value))
    client.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_corrupted_block_fails_verify(fleet: Fleet, connector: str) -> None:
    available(connector)
    p = fleet.p
    prompts = [fresh_prompt(48), fresh_prompt(48)]
    firsts = prefill(p, connector, prompts)
    if connector in P2P:
        # The hold (and its checksums, verify: true) begins at the producer's next step; then
        # its memory changes under the lease.
        p.call("step", connector)
        p.call(
            "corrupt", connector, [f["kv_transfer_params"]["remote_block_ids"][1] for f in firsts]
        )
        p.send("wait_for_transfers", connector, WAIT_S)
        run_both_policies(fleet, connector, prompts, firsts, "checksum mismatch in block 1")
        waited = p.recv(WAIT_S + 30)
        assert waited["ok"] is True, waited
    else:  # stored (with checksums); now flip bytes inside block 1's stored value
        assert p.call("wait_for_transfers", connector, WAIT_S)["ok"]
        _corrupt_stored_block(fleet, firsts[1], 1)
        # `recompute` after a corrupted store block: test_recompute_after_bad_store_block.
        check_fault(fleet, connector, "fail", prompts[1], firsts[1], "checksum mismatch")
    all_blocks_free(p, connector)


def test_recompute_after_bad_store_block(fleet: Fleet) -> None:
    """A stored block that fails verification: `recompute` must prefill locally once, not keep
    loading the same bad block (the same happens for any bad stored value, e.g. a consumer with
    verify on and a producer without)."""
    p, d = fleet.p, fleet.d
    prompt = [fresh_prompt(48)]
    first = prefill(p, "redis", prompt)
    assert p.call("wait_for_transfers", "redis", WAIT_S)["ok"]
    _corrupt_stored_block(fleet, first[0], 1)
    before = d.call("stats", "redis-recompute")["connector"]
    try:
        [out] = d.call(
            "generate",
            "redis-recompute",
            [prompt[0] + first[0]["token_ids"]],
            COLOCATED,
            [first[0]["kv_transfer_params"]],
            3.0,
            1,  # num_prior_output_tokens: t0
        )
    finally:
        after = d.call("stats", "redis-recompute")
        assert after["kv_blocks_free"] == after["kv_blocks_total"], after
    assert first[0]["token_ids"] + out["token_ids"] == fleet.reference(prompt)[0]
    assert after["connector"]["num_failed_transfers"] == before["num_failed_transfers"] + 1


@pytest.mark.parametrize("connector", P2P)
def test_killed_producer(fleet: Fleet, connector: str) -> None:
    """A producer SIGKILLed after it returned kv_transfer_params (and began holding the blocks),
    before the consumer loads: to a consumer that already talked to it (warm) and to one that
    did not (cold, the handshake fails)."""
    available(connector)
    d = fleet.d
    victim = EngineProcess("victim", fleet.model, {connector: kv_config(connector, "producer")})
    try:
        victim.ready()
        warm = [fresh_prompt(24)]
        first = prefill(victim, connector, warm)
        victim.send("wait_for_transfers", connector, WAIT_S)
        [out] = decode(d, f"{connector}-recompute", warm, first)
        assert first[0]["token_ids"] + out["token_ids"] == fleet.reference(warm)[0]
        assert out["num_cached_tokens"] == 24
        assert victim.recv(WAIT_S + 30)["ok"]

        prompts = [fresh_prompt(40), fresh_prompt(40)]
        firsts = prefill(victim, connector, prompts)
        victim.call("step", connector)  # the holds begin, as they would right after answering
        victim.kill()
        run_both_policies(fleet, connector, prompts, firsts, "producer")
    finally:
        victim.close()


def test_redis_stopped(fleet: Fleet) -> None:
    """The store goes away between the producer's save and the consumer's load; a save while it
    is down fails but still frees the producer's blocks."""
    p, name = fleet.p, "redis-stop"
    prompts = [fresh_prompt(48), fresh_prompt(48)]
    firsts = prefill(p, name, prompts)
    assert p.call("wait_for_transfers", name, WAIT_S)["ok"]  # saved
    p0 = p.call("stats", name)
    assert p0["connector"]["blocks_saved"] == 6
    fleet.stoppable.stop()
    run_both_policies(fleet, name, prompts, firsts, "Redis", "store")

    late = [fresh_prompt(48)]
    first = prefill(p, name, late)
    assert p.call("wait_for_transfers", name, WAIT_S)["ok"]  # the save failed, blocks freed
    p1 = p.call("stats", name)
    assert p1["connector"]["num_failed_transfers"] == p0["connector"]["num_failed_transfers"] + 1
    all_blocks_free(p, name)
    [out] = decode(fleet.d, f"{name}-recompute", late, first)
    assert first[0]["token_ids"] + out["token_ids"] == fleet.reference(late)[0], out
    assert out["num_cached_tokens"] == 0
    all_blocks_free(fleet.d)
