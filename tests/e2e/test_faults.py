"""Faults on a 2P2D NIXL fleet: prefill killed under load, decode killed mid-stream and back."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time

import httpx
import openai
import pytest
from fleet_helpers import MODEL_NAME, PROMPTS, start_fleet, wait_all_blocks_free


@pytest.fixture(scope="module")
def fleet(llama_fp32, tmp_path_factory):
    running = start_fleet("2p2d-nixl", llama_fp32, tmp_path_factory.mktemp("faults"))
    yield running
    running.stop()


def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60)


def healthy(fleet) -> dict[str, bool]:
    return {i["url"]: i["healthy"] for i in httpx.get(f"{fleet.url}/health").json()["instances"]}


def wait_for(pred, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.25)


def test_kill_prefill_under_load_every_request_completes(fleet):
    c = client(fleet)

    def one(i: int) -> str:
        try:
            r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[i % 4] * 3, max_tokens=16,
                                     temperature=0)
            return "ok" if r.usage.completion_tokens == 16 else "short"
        except openai.APIError as err:  # a clear error is allowed; a hang is not
            return f"error {err}"

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        time.sleep(0.5)
        os.killpg(fleet.child("prefill-0").proc.pid, signal.SIGKILL)
        results = [f.result(timeout=90) for f in futures]
    assert results.count("ok") >= 12, results
    p0 = fleet.fleet.prefill.url(0)
    wait_for(lambda: healthy(fleet)[p0] is False, 10)
    # With prefill-0 gone, requests still succeed (the other P, or decode-only).
    assert c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                temperature=0).usage.completion_tokens == 4
    wait_all_blocks_free(fleet)


def _served(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r'^splitserve:request_success_total\{.*\} (\S+)$',
                                            text, re.M))


def test_kill_decode_streams_fail_others_continue_then_restart(fleet):
    c = client(fleet)
    d0, d1 = fleet.fleet.decode.url(0), fleet.fleet.decode.url(1)

    def stream(i: int) -> str:
        try:
            s = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[i % 4], max_tokens=200,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            n = sum(1 for ch in s if ch.choices)
            return f"ok {n}"
        except openai.APIError as err:
            return f"error {type(err).__name__}"

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        time.sleep(2.0)
        os.killpg(fleet.child("decode-0").proc.pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    assert any(r.startswith("error") for r in results) or all(r.startswith("ok") for r in results)
    assert any(r.startswith("ok") for r in results), results  # d1's streams were unaffected
    wait_for(lambda: healthy(fleet)[d0] is False, 10)
    ok = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert ok.usage.completion_tokens == 8
    fleet.children.remove(fleet.child("decode-0"))
    fleet.start_instance("decode", 0)
    wait_for(lambda: healthy(fleet)[d0] is True, 90)
    before = _served(d0)
    for i in range(6):
        c.completions.create(model=MODEL_NAME, prompt=PROMPTS[i % 4], max_tokens=4,
                             temperature=0)
    assert _served(d0) > before  # back in rotation
    assert _served(d1) > 0
    wait_all_blocks_free(fleet)
