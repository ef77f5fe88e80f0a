"""The engine fleet of the engine-level KV transfer tests, and the router's calls to it.

Engines: one "prefill" process with a producer per connector, one "decode" process with a consumer
per (connector, policy) plus the colocated reference (a uniquely named module: tests/ has no
packages). Flow, as the router drives it: the producer generates t0 (`max_tokens=1`,
`do_remote_decode`) and returns kv_transfer_params; it then steps (`wait_for_transfers`) so it
serves the pull and frees its blocks; the consumer generates the rest from `prompt + [t0]` with
those params, t0 as prior output (`num_prior_output_tokens=1`, the client's max_tokens).
"""

from __future__ import annotations

import itertools
import random
import time
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
COLOCATED = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}


def kv_config(connector: str, role: str, policy: str = "recompute", url: str | None = None) -> dict:
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


def available(connector: str) -> None:
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

        producers = {n: kv_config(conn(n), "producer", url=urls.get(n)) for n in names}
        consumers: dict[str, dict] = {"colocated": {"connector": "none"}}
        for n in names:
            for policy in POLICIES:
                consumers[f"{n}-{policy}"] = kv_config(conn(n), "consumer", policy, urls.get(n))
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


_seeds = itertools.count(1)


def fresh_prompt(n: int, prefix: list[int] | None = None) -> list[int]:
    """A prompt no other test uses (no prefix-cache hits by accident); never token 0 (EOS)."""
    rng = random.Random(next(_seeds) * 7919)
    head = list(prefix or [])
    return head + [rng.randrange(1, 8192) for _ in range(n - len(head))]


def prefill(
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


def decode(
    d: EngineProcess, engine: str, prompts: list[list[int]], firsts: list[dict]
) -> list[dict]:
    """The router's call to the consumer: prompt + [t0] with the producer's params, t0 counted
    as output already (so the consumer loads the whole prompt's KV and computes only t0)."""
    return d.call(
        "generate",
        engine,
        [p + f["token_ids"] for p, f in zip(prompts, firsts, strict=True)],
        COLOCATED,
        [f["kv_transfer_params"] for f in firsts],
        40.0,  # timeout_s
        1,  # num_prior_output_tokens
    )


def all_blocks_free(proc: EngineProcess, *engines: str) -> None:
    for name, s in proc.call("all_stats").items():
        if engines and name not in engines:
            continue
        assert s["kv_blocks_free"] == s["kv_blocks_total"], (proc.label, name, s)
        assert s["held_for_transfer"] == 0 and s["running"] == s["waiting"] == 0, (name, s)


def loaded_tokens(connector: str, n: int) -> int:
    """Prompt tokens the consumer loads: all of them (p2p) or its full blocks (redis)."""
    return n if connector in P2P else n // BS * BS


def loaded_blocks(connector: str, n: int) -> int:
    return -(-n // BS) if connector in P2P else n // BS


def assert_error(out: dict, *needles: str) -> None:
    """A clear error output, never tokens: the failure_policy `fail` contract."""
    assert out["finish_reason"] == "error", out
    assert out["token_ids"] == [], out
    assert out["error"] and out["error"].startswith("KV load failed"), out
    assert any(s in out["error"] for s in needles), (needles, out["error"])


def check_fault(
    fleet: Fleet, name: str, policy: str, prompt: list[int], first: dict, *needles: str
) -> dict:
    """A consumer load that must fail: recompute gives the colocated tokens, fail an error."""
    d, consumer = fleet.d, f"{name}-{policy}"
    want = fleet.reference([prompt])[0]
    before = d.call("stats", consumer)["connector"]
    started = time.monotonic()
    [out] = decode(d, consumer, [prompt], [first])
    elapsed = time.monotonic() - started
    if policy == "recompute":
        assert out["finish_reason"] == "length" and out["error"] is None, out
        assert first["token_ids"] + out["token_ids"] == want, (out, want)
        assert out["num_cached_tokens"] == 0, out  # recomputed, nothing loaded
    else:
        assert_error(out, *needles)
    assert elapsed < 3 * TIMEOUT_S + 2, f"the fault took {elapsed:.1f}s to surface"
    after = d.call("stats", consumer)["connector"]
    assert after["num_failed_transfers"] == before["num_failed_transfers"] + 1, after
    assert after["blocks_loaded"] == before["blocks_loaded"], after
    all_blocks_free(d, consumer)
    return out


def run_both_policies(
    fleet: Fleet, name: str, prompts: list[list[int]], firsts: list[dict], *needles: str
) -> None:
    """Prompt 0 goes to the `recompute` consumer, prompt 1 to the `fail` one."""
    for policy, prompt, first in zip(POLICIES, prompts, firsts, strict=True):
        check_fault(fleet, name, policy, prompt, first, *needles)
