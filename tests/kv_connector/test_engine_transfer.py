"""Engine-level KV transfer (issue 5), the happy paths: a producer `LLM` and a consumer `LLM` in
two processes, as the router drives them, for every connector; real processes, real transports,
no mocks (the fleet: engine_fleet.py, faults: test_engine_faults.py).

`[t0] + rest` must equal a colocated engine's greedy tokens, token for token, and the KV must
really have been loaded (num_cached_tokens, connector stats), not recomputed. After everything,
every KV block is free on every engine.
"""

from __future__ import annotations

import pytest
from engine_fleet import (
    CONNECTORS,
    LEASE_S,
    P2P,
    WAIT_S,
    Fleet,
    all_blocks_free,
    available,
    decode,
    fresh_prompt,
    loaded_blocks,
    loaded_tokens,
    prefill,
)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_pd_matches_colocated(fleet: Fleet, connector: str) -> None:
    available(connector)
    p, d = fleet.p, fleet.d
    consumer = f"{connector}-recompute"
    # 10: less than a block (redis stores nothing); 32: t0 opens a new block on the consumer.
    prompts = [fresh_prompt(n) for n in (40, 32, 75, 10)]
    want = fleet.reference(prompts)
    p0, d0 = p.call("stats", connector), d.call("stats", consumer)

    firsts = prefill(p, connector, prompts)
    assert [f["token_ids"] for f in firsts] == [w[:1] for w in want]
    params = firsts[0]["kv_transfer_params"]
    assert params["connector"] == connector and params["remote_engine_id"]
    if connector in P2P:
        assert [f["kv_transfer_params"]["num_tokens"] for f in firsts] == [40, 32, 75, 10]
        assert params["lease_s"] == LEASE_S
    else:
        assert [len(f["kv_transfer_params"]["block_hashes"]) for f in firsts] == [2, 2, 4, 0]
    p.send("wait_for_transfers", connector, WAIT_S)  # the producer steps: serves, then frees
    outs = decode(d, consumer, prompts, firsts)
    waited = p.recv(WAIT_S + 30)

    for prompt, first, out, w in zip(prompts, firsts, outs, want, strict=True):
        assert out["finish_reason"] == "length" and out["error"] is None, out
        assert first["token_ids"] + out["token_ids"] == w, (len(prompt), out, w)
        assert out["num_cached_tokens"] == loaded_tokens(connector, len(prompt)), out
    # Blocks came back because the consumer was done (or the save landed), not by lease.
    assert waited["ok"] is True, waited
    p1, d1 = p.call("stats", connector), d.call("stats", consumer)
    blocks = sum(loaded_blocks(connector, len(x)) for x in prompts)
    assert p1["connector"]["expired_leases"] == p0["connector"]["expired_leases"]
    assert p1["connector"]["blocks_saved"] - p0["connector"]["blocks_saved"] == blocks
    assert d1["connector"]["blocks_loaded"] - d0["connector"]["blocks_loaded"] == blocks
    assert d1["connector"]["num_failed_transfers"] == d0["connector"]["num_failed_transfers"]
    all_blocks_free(p, connector)
    all_blocks_free(d, consumer)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_consumer_prefix_hit_loads_only_the_rest(fleet: Fleet, connector: str) -> None:
    """A consumer that already holds a prompt's first blocks loads only the blocks past them;
    one that holds all of them loads nothing and lets the producer free its blocks at once."""
    available(connector)
    p, d = fleet.p, fleet.d
    consumer = f"{connector}-recompute"
    warm = [fresh_prompt(40), fresh_prompt(32)]
    first = prefill(p, connector, warm)
    p.send("wait_for_transfers", connector, WAIT_S)
    decode(d, consumer, warm, first)
    assert p.recv(WAIT_S + 30)["ok"]

    prompts = [fresh_prompt(44, prefix=warm[0][:32]), list(warm[1])]  # 2 of 3 / 2 of 2 blocks held
    want = fleet.reference(prompts)
    d0 = d.call("stats", consumer)
    firsts = prefill(p, connector, prompts)
    p.send("wait_for_transfers", connector, WAIT_S)
    outs = decode(d, consumer, prompts, firsts)
    waited = p.recv(WAIT_S + 30)
    for f, out, w in zip(firsts, outs, want, strict=True):
        assert f["token_ids"] + out["token_ids"] == w, (out, w)
    assert [o["num_cached_tokens"] for o in outs] == (
        [44, 32] if connector in P2P else [32, 32]  # local hits + loaded
    )
    d1 = d.call("stats", consumer)
    loaded = d1["connector"]["blocks_loaded"] - d0["connector"]["blocks_loaded"]
    assert loaded == (1 if connector in P2P else 0)
    assert d1["prefix_cache_hits"] - d0["prefix_cache_hits"] == 64
    assert waited["ok"] is True, waited  # the fully cached one was released, not left to lease
    all_blocks_free(p, connector)
    all_blocks_free(d, consumer)
