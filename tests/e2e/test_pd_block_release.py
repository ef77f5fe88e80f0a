"""Blocks a prefill instance holds for a decode instance never outlive the request: whatever
ends it early (no decode instance, the router giving up on P's answer, clients leaving at any
moment, mid-body) frees them at once, well inside the fleet's 5 s lease, never at its end.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleet_helpers import MODEL_NAME, start_fleet, wait_all_blocks_free
from testutil import send_truncated_body

PROMPT = "import os\nimport sys\n"


@pytest.fixture(scope="module")
def fleet(llama_fp32, tmp_path_factory):
    running = start_fleet("1p1d-nixl", llama_fp32, tmp_path_factory.mktemp("1p1d-nixl"))
    yield running
    running.stop()


def _completion_tokens(fleet, stream: bool) -> int:
    """A request through the fleet still completes: its usage's completion tokens."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    r = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]["completion_tokens"]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    return json.loads(events[-1])["usage"]["completion_tokens"]


def test_prefill_blocks_freed_when_no_decode_instance_takes_the_request(fleet):
    """P holds a request's KV for D under a lease (5 s in these fleets). With the decode instance gone
    from the router, the request fails after t0 (503 / an error event) and the router must free
    P's blocks at once, not leave them to the lease."""
    decode_url = next(u for role, _, u in fleet.fleet.instances() if role == "decode")
    body = {"model": MODEL_NAME, "prompt": PROMPT * 8, "max_tokens": 8}
    r = httpx.request("DELETE", f"{fleet.url}/register", json={"url": decode_url})
    assert r.status_code == 200
    try:
        answer = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 503, answer.text
        streamed = httpx.post(f"{fleet.url}/v1/completions", json={**body, "stream": True},
                              timeout=60)
        assert "no_healthy_instance" in streamed.text
        wait_all_blocks_free(fleet, timeout_s=2.5)  # well inside the 5 s lease
    finally:
        httpx.post(f"{fleet.url}/register", json={"url": decode_url, "role": "decode"})
    assert _completion_tokens(fleet, stream=True) == 4


def _held_blocks(url: str) -> int:
    stats = httpx.get(f"{url}/health", timeout=5).json()
    return stats["kv_blocks_total"] - stats["kv_blocks_free"]


def test_release_by_request_id_before_and_after_the_prefill_finishes(fleet):
    """`POST /v1/kv/release {"request_id"}` on a prefill instance: the router's way to say it
    gave up on an answer. Sent after the request finished, it frees the held blocks at once; sent
    before, the hold ends as soon as the request finishes. Either well inside the 5 s lease."""
    prefill_url = next(u for role, _, u in fleet.fleet.instances() if role == "prefill")
    body = {"model": MODEL_NAME, "prompt": PROMPT * 8, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}

    def prefill(request_id: str) -> dict[str, Any]:
        r = httpx.post(f"{prefill_url}/v1/completions", json=body, timeout=60,
                       headers={"X-Request-Id": request_id})
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"]["remote_block_ids"]
        return r.json()

    def release(request_id: str) -> bool:
        r = httpx.post(f"{prefill_url}/v1/kv/release", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        return r.json()["released"]

    prefill("given-up-after")
    assert _held_blocks(prefill_url) > 0
    assert release("given-up-after") is True
    wait_all_blocks_free(fleet, timeout_s=2.5)

    assert release("given-up-before") is False  # nothing held yet
    prefill("given-up-before")
    wait_all_blocks_free(fleet, timeout_s=2.5)

    for bad in ({}, {"request_id": "x", "kv_transfer_params": {}}, {"request_id": ""}):
        r = httpx.post(f"{prefill_url}/v1/kv/release", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["message"]


def test_clients_leaving_at_any_moment_leave_no_blocks_held(fleet):
    """Clients that give up at random moments (while P computes, between P and D, while D
    streams), streamed and not: every block on both instances is free well inside the 5 s
    lease, whichever side was holding it when the client left."""
    rng = random.Random(5)

    def leave_early(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"{i} " + PROMPT * rng.randint(4, 40),
                "max_tokens": 32, "stream": i % 2 == 0}
        try:
            with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body,
                              timeout=rng.uniform(0.002, 0.15)) as r:
                for _ in r.iter_bytes():
                    pass
        except httpx.HTTPError:
            pass

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(leave_early, range(64)))
    wait_all_blocks_free(fleet, timeout_s=2.5)


def test_client_leaving_mid_body_is_not_a_router_error(fleet):
    log = Path(fleet.log_file.name)
    before = log.read_text()
    send_truncated_body(fleet.url, "/v1/completions")
    after = log.read_text()[len(before):]
    assert "Traceback" not in after and "Exception in ASGI" not in after, after
    assert _completion_tokens(fleet, stream=False) == 4
