"""Engine-level KV transfer (issue 5): a producer `LLM` and a consumer `LLM` in two processes, as
the router drives them, for every connector; real processes, real transports, no mocks.

Flow: the producer generates t0 (`max_tokens=1`, `do_remote_decode`) and returns
kv_transfer_params; it then steps (`wait_for_transfers`) so it serves the pull and frees its
blocks; the consumer generates the rest from `prompt + [t0]` with those params. `[t0] + rest` must
equal a colocated engine's greedy tokens, token for token, and the KV must really have been loaded
(num_cached_tokens, connector stats), not recomputed. Faults (producer SIGKILLed, lease expired,
Redis stopped, a block corrupted under verify) must give the colocated tokens under
`failure_policy: recompute` and a clear error, never other tokens, under `fail`. After everything,
every KV block is free on every engine.

Engines: one "prefill" process with a producer per connector, one "decode" process with a consumer
per (connector, policy) plus the colocated reference; the kill test starts its own producer.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from engine_peers import EngineProcess
from kvc_helpers import RedisServer, nixl_missing

TIMEOUT_S = 3.0  # connector timeout_s: the longest a fault may take to surface
N = 8  # tokens per request: t0 from the producer, N - 1 from the consumer
BS = 16  # the engine's default block size
WAIT_S = 20.0  # producer wait_for_transfers; below lease_s, so True means "released by done"
LEASE_S = 30.0
P2P = ["nixl", "nccl"]
CONNECTORS = [*P2P, "redis"]
NIXL_MISSING = nixl_missing()
POLICIES = ["recompute", "fail"]

GREEDY_T0 = {"temperature": 0.0, "max_tokens": 1}
REST = {"temperature": 0.0, "max_tokens": N - 1, "ignore_eos": True}
COLOCATED = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}


def _kv(connector: str, role: str, policy: str = "recompute", url: str | None = None) -> dict:
    options: dict[str, Any] = {"timeout_s": TIMEOUT_S}
    if connector == "redis":
        options = {"url": url, "timeout_s": TIMEOUT_S, "wait_s": 1.0, "ttl_s": 600}
    return {
        "connector": connector,
        "kv_role": role,
        "failure_policy": policy,
        "verify": True,
        "lease_s": LEASE_S,
        "options": options,
    }


def _available(connector: str) -> None:
    if connector == "nixl" and NIXL_MISSING:
        pytest.skip(NIXL_MISSING)


class Fleet:
    def __init__(self, model: str, redis: RedisServer, stoppable: RedisServer) -> None:
        self.model = model
        self.redis, self.stoppable = redis, stoppable
        urls = {"redis": redis.url, "redis-stop": stoppable.url}
        names = [c for c in CONNECTORS if not (c == "nixl" and NIXL_MISSING)] + ["redis-stop"]

        def conn(name: str) -> str:
            return "redis" if name.startswith("redis") else name

        producers = {n: _kv(conn(n), "producer", url=urls.get(n)) for n in names}
        consumers: dict[str, dict] = {"colocated": {"connector": "none"}}
        for n in names:
            for policy in POLICIES:
                consumers[f"{n}-{policy}"] = _kv(conn(n), "consumer", policy, urls.get(n))
        self.p = EngineProcess("prefill", model, producers)
        self.d = EngineProcess("decode", model, consumers)
        try:
            self.p.ready()
            self.d.ready()
        except BaseException:
            self.close()
            raise
        self._reference: dict[tuple[int, ...], list[int]] = {}

    def reference(self, prompts: list[list[int]]) -> list[list[int]]:
        """Colocated greedy tokens (one batch, as the producer runs them)."""
        todo = [p for p in prompts if tuple(p) not in self._reference]
        if todo:
            for p, out in zip(
                todo, self.d.call("generate", "colocated", todo, COLOCATED, None), strict=True
            ):
                assert len(out["token_ids"]) == N, out
                self._reference[tuple(p)] = out["token_ids"]
        return [self._reference[tuple(p)] for p in prompts]

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture(scope="module")
def fleet(llama_fp32: str, redis_server: RedisServer) -> Iterator[Fleet]:
    stoppable = RedisServer()  # the Redis-stopped test kills this one
    try:
        f = Fleet(llama_fp32, redis_server, stoppable)
    except BaseException:
        stoppable.stop()
        raise
    yield f
    f.close()
    stoppable.stop()


_seeds = itertools.count(1)


def _prompt(n: int, prefix: list[int] | None = None) -> list[int]:
    """A prompt no other test uses (no prefix-cache hits by accident); never token 0 (EOS)."""
    rng = random.Random(next(_seeds) * 7919)
    head = list(prefix or [])
    return head + [rng.randrange(1, 8192) for _ in range(n - len(head))]


def _prefill(
    p: EngineProcess, engine: str, prompts: list[list[int]], lease_s: float | None = None
) -> list[dict]:
    """The router's call to the producer: t0 and kv_transfer_params for each prompt."""
    ask: dict[str, Any] = {"do_remote_decode": True}
    if lease_s is not None:
        ask["lease_s"] = lease_s
    outs = p.call("generate", engine, prompts, GREEDY_T0, [ask] * len(prompts))
    for out in outs:
        assert len(out["token_ids"]) == 1 and out["finish_reason"] == "length", out
        assert out["kv_transfer_params"] is not None, out
        assert out["kv_transfer_params"]["do_remote_prefill"] is True
    return outs


def _decode(
    d: EngineProcess, engine: str, prompts: list[list[int]], firsts: list[dict]
) -> list[dict]:
    """The router's call to the consumer: prompt + [t0] with the producer's params."""
    return d.call(
        "generate",
        engine,
        [p + f["token_ids"] for p, f in zip(prompts, firsts, strict=True)],
        REST,
        [f["kv_transfer_params"] for f in firsts],
    )


def _all_blocks_free(proc: EngineProcess, *engines: str) -> None:
    for name, s in proc.call("all_stats").items():
        if engines and name not in engines:
            continue
        assert s["kv_blocks_free"] == s["kv_blocks_total"], (proc.label, name, s)
        assert s["held_for_transfer"] == 0 and s["running"] == s["waiting"] == 0, (name, s)


def _loaded_tokens(connector: str, n: int) -> int:
    """Prompt tokens the consumer loads: all of them (p2p) or its full blocks (redis)."""
    return n if connector in P2P else n // BS * BS


def _loaded_blocks(connector: str, n: int) -> int:
    return -(-n // BS) if connector in P2P else n // BS


def _assert_error(out: dict, *needles: str) -> None:
    """A clear error output, never tokens: the failure_policy `fail` contract."""
    assert out["finish_reason"] == "error", out
    assert out["token_ids"] == [], out
    assert out["error"] and out["error"].startswith("KV load failed"), out
    assert any(s in out["error"] for s in needles), (needles, out["error"])


# ---------------------------------------------------------------------------------- happy path
@pytest.mark.parametrize("connector", CONNECTORS)
def test_pd_matches_colocated(fleet: Fleet, connector: str) -> None:
    _available(connector)
    p, d = fleet.p, fleet.d
    consumer = f"{connector}-recompute"
    # 10: less than a block (redis stores nothing); 32: t0 opens a new block on the consumer.
    prompts = [_prompt(n) for n in (40, 32, 75, 10)]
    want = fleet.reference(prompts)
    p0, d0 = p.call("stats", connector), d.call("stats", consumer)

    firsts = _prefill(p, connector, prompts)
    assert [f["token_ids"] for f in firsts] == [w[:1] for w in want]
    params = firsts[0]["kv_transfer_params"]
    assert params["connector"] == connector and params["remote_engine_id"]
    if connector in P2P:
        assert [f["kv_transfer_params"]["num_tokens"] for f in firsts] == [40, 32, 75, 10]
        assert params["lease_s"] == LEASE_S
    else:
        assert [len(f["kv_transfer_params"]["block_hashes"]) for f in firsts] == [2, 2, 4, 0]
    p.send("wait_for_transfers", connector, WAIT_S)  # the producer steps: serves, then frees
    outs = _decode(d, consumer, prompts, firsts)
    waited = p.recv(WAIT_S + 30)

    for prompt, first, out, w in zip(prompts, firsts, outs, want, strict=True):
        assert out["finish_reason"] == "length" and out["error"] is None, out
        assert first["token_ids"] + out["token_ids"] == w, (len(prompt), out, w)
        assert out["num_cached_tokens"] == _loaded_tokens(connector, len(prompt)), out
    # Blocks came back because the consumer was done (or the save landed), not by lease.
    assert waited["ok"] is True, waited
    p1, d1 = p.call("stats", connector), d.call("stats", consumer)
    blocks = sum(_loaded_blocks(connector, len(x)) for x in prompts)
    assert p1["connector"]["expired_leases"] == p0["connector"]["expired_leases"]
    assert p1["connector"]["blocks_saved"] - p0["connector"]["blocks_saved"] == blocks
    assert d1["connector"]["blocks_loaded"] - d0["connector"]["blocks_loaded"] == blocks
    assert d1["connector"]["num_failed_transfers"] == d0["connector"]["num_failed_transfers"]
    _all_blocks_free(p, connector)
    _all_blocks_free(d, consumer)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_consumer_prefix_hit_loads_only_the_rest(fleet: Fleet, connector: str) -> None:
    """A consumer that already holds a prompt's first blocks loads only the blocks past them;
    one that holds all of them loads nothing and lets the producer free its blocks at once."""
    _available(connector)
    p, d = fleet.p, fleet.d
    consumer = f"{connector}-recompute"
    warm = [_prompt(40), _prompt(32)]
    first = _prefill(p, connector, warm)
    p.send("wait_for_transfers", connector, WAIT_S)
    _decode(d, consumer, warm, first)
    assert p.recv(WAIT_S + 30)["ok"]

    prompts = [_prompt(44, prefix=warm[0][:32]), list(warm[1])]  # 2 of 3 / 2 of 2 blocks held
    want = fleet.reference(prompts)
    d0 = d.call("stats", consumer)
    firsts = _prefill(p, connector, prompts)
    p.send("wait_for_transfers", connector, WAIT_S)
    outs = _decode(d, consumer, prompts, firsts)
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
    _all_blocks_free(p, connector)
    _all_blocks_free(d, consumer)


# ---------------------------------------------------------------------------------- faults
def _check_fault(
    fleet: Fleet, name: str, policy: str, prompt: list[int], first: dict, *needles: str
) -> dict:
    """A consumer load that must fail: recompute gives the colocated tokens, fail an error."""
    d, consumer = fleet.d, f"{name}-{policy}"
    want = fleet.reference([prompt])[0]
    before = d.call("stats", consumer)["connector"]
    started = time.monotonic()
    [out] = _decode(d, consumer, [prompt], [first])
    elapsed = time.monotonic() - started
    if policy == "recompute":
        assert out["finish_reason"] == "length" and out["error"] is None, out
        assert first["token_ids"] + out["token_ids"] == want, (out, want)
        assert out["num_cached_tokens"] == 0, out  # recomputed, nothing loaded
    else:
        _assert_error(out, *needles)
    assert elapsed < 3 * TIMEOUT_S + 2, f"the fault took {elapsed:.1f}s to surface"
    after = d.call("stats", consumer)["connector"]
    assert after["num_failed_transfers"] == before["num_failed_transfers"] + 1, after
    assert after["blocks_loaded"] == before["blocks_loaded"], after
    _all_blocks_free(d, consumer)
    return out


def _run_both_policies(
    fleet: Fleet, name: str, prompts: list[list[int]], firsts: list[dict], *needles: str
) -> None:
    """Prompt 0 goes to the `recompute` consumer, prompt 1 to the `fail` one."""
    for policy, prompt, first in zip(POLICIES, prompts, firsts, strict=True):
        _check_fault(fleet, name, policy, prompt, first, *needles)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_late_consumer_after_lease(fleet: Fleet, connector: str) -> None:
    """nixl/nccl: the router's short lease ends before the consumer comes; the producer frees
    the blocks by itself. redis: the stored blocks are evicted before the consumer comes."""
    _available(connector)
    p = fleet.p
    prompts = [_prompt(40), _prompt(40)]
    p0 = p.call("stats", connector)
    firsts = _prefill(p, connector, prompts, lease_s=0.3)
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
    _all_blocks_free(p, connector)
    _run_both_policies(fleet, connector, prompts, firsts, *needles)


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
    _available(connector)
    p = fleet.p
    prompts = [_prompt(48), _prompt(48)]
    firsts = _prefill(p, connector, prompts)
    if connector in P2P:
        # The hold (and its checksums, verify: true) begins at the producer's next step; then
        # its memory changes under the lease.
        p.call("step", connector)
        p.call(
            "corrupt", connector, [f["kv_transfer_params"]["remote_block_ids"][1] for f in firsts]
        )
        p.send("wait_for_transfers", connector, WAIT_S)
        _run_both_policies(fleet, connector, prompts, firsts, "checksum mismatch in block 1")
        waited = p.recv(WAIT_S + 30)
        assert waited["ok"] is True, waited
    else:  # stored (with checksums); now flip bytes inside block 1's stored value
        assert p.call("wait_for_transfers", connector, WAIT_S)["ok"]
        _corrupt_stored_block(fleet, firsts[1], 1)
        # `recompute` after a corrupted store block: test_recompute_after_bad_store_block.
        _check_fault(fleet, connector, "fail", prompts[1], firsts[1], "checksum mismatch")
    _all_blocks_free(p, connector)


def test_recompute_after_bad_store_block(fleet: Fleet) -> None:
    """A stored block that fails verification: `recompute` must prefill locally once, not keep
    loading the same bad block (the same happens for any bad stored value, e.g. a consumer with
    verify on and a producer without)."""
    p, d = fleet.p, fleet.d
    prompt = [_prompt(48)]
    first = _prefill(p, "redis", prompt)
    assert p.call("wait_for_transfers", "redis", WAIT_S)["ok"]
    _corrupt_stored_block(fleet, first[0], 1)
    before = d.call("stats", "redis-recompute")["connector"]
    try:
        [out] = d.call(
            "generate",
            "redis-recompute",
            [prompt[0] + first[0]["token_ids"]],
            REST,
            [first[0]["kv_transfer_params"]],
            3.0,
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
    _available(connector)
    d = fleet.d
    victim = EngineProcess("victim", fleet.model, {connector: _kv(connector, "producer")})
    try:
        victim.ready()
        warm = [_prompt(24)]
        first = _prefill(victim, connector, warm)
        victim.send("wait_for_transfers", connector, WAIT_S)
        [out] = _decode(d, f"{connector}-recompute", warm, first)
        assert first[0]["token_ids"] + out["token_ids"] == fleet.reference(warm)[0]
        assert out["num_cached_tokens"] == 24
        assert victim.recv(WAIT_S + 30)["ok"]

        prompts = [_prompt(40), _prompt(40)]
        firsts = _prefill(victim, connector, prompts)
        victim.call("step", connector)  # the holds begin, as they would right after answering
        victim.kill()
        _run_both_policies(fleet, connector, prompts, firsts, "producer")
    finally:
        victim.close()


def test_redis_stopped(fleet: Fleet) -> None:
    """The store goes away between the producer's save and the consumer's load; a save while it
    is down fails but still frees the producer's blocks."""
    p, name = fleet.p, "redis-stop"
    prompts = [_prompt(48), _prompt(48)]
    firsts = _prefill(p, name, prompts)
    assert p.call("wait_for_transfers", name, WAIT_S)["ok"]  # saved
    p0 = p.call("stats", name)
    assert p0["connector"]["blocks_saved"] == 6
    fleet.stoppable.stop()
    _run_both_policies(fleet, name, prompts, firsts, "Redis", "store")

    late = [_prompt(48)]
    first = _prefill(p, name, late)
    assert p.call("wait_for_transfers", name, WAIT_S)["ok"]  # the save failed, blocks freed
    p1 = p.call("stats", name)
    assert p1["connector"]["num_failed_transfers"] == p0["connector"]["num_failed_transfers"] + 1
    _all_blocks_free(p, name)
    [out] = _decode(fleet.d, f"{name}-recompute", late, first)
    assert first[0]["token_ids"] + out["token_ids"] == fleet.reference(late)[0], out
    assert out["num_cached_tokens"] == 0
    _all_blocks_free(fleet.d)
