"""Every fleet config through the router: greedy parity with offline LLM.generate, streaming,
chat, seeded sampling equal across topologies, bad input answered like an instance, and every
block back in the free queue afterwards."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest
from fleet_helpers import MODEL_NAME, PROMPTS, start_fleet, wait_all_blocks_free

CONFIGS = ["colocated", "1p1d-nixl", "1p1d-redis", "1p1d-nccl", "2p2d-nixl", "2p1d-redis"]
SEEDED: dict[str, list[str]] = {}


@pytest.fixture(scope="module", params=CONFIGS)
def fleet(request, llama_fp32, tmp_path_factory):
    running = start_fleet(request.param, llama_fp32, tmp_path_factory.mktemp(request.param))
    running.name = request.param
    yield running
    running.stop()


def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_greedy_parity(fleet, reference):
    c = client(fleet)

    def one(prompt: str) -> str:
        return c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                    temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, PROMPTS))
    assert texts == [reference[p] for p in PROMPTS]
    wait_all_blocks_free(fleet)


def test_streaming_completion_and_usage(fleet, reference):
    c = client(fleet)
    prompt = PROMPTS[0]
    stream = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == reference[prompt]
    assert usage is not None and usage.completion_tokens == 24
    direct = httpx.post(f"{fleet.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert usage.prompt_tokens == direct.json()["usage"]["prompt_tokens"]
    wait_all_blocks_free(fleet)


def test_chat_stream_equals_non_stream(fleet):
    c = client(fleet)
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    full = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16,
                                     temperature=0)
    stream = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16,
                                       temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == full.choices[0].message.content
    assert full.usage.completion_tokens == 16
    wait_all_blocks_free(fleet)


def test_stop_at_first_token(fleet):
    c = client(fleet)
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    # Released by the router at once, well before the 5 s lease of the test fleets.
    wait_all_blocks_free(fleet, timeout_s=2.5)


@pytest.mark.parametrize("seed", [7])
def test_seeded_sampling_same_across_topologies(fleet, seed):
    if fleet.name not in ("colocated", "1p1d-nixl", "2p2d-nixl"):
        pytest.skip("compared on colocated, 1P1D and 2P2D")
    c = client(fleet)
    texts = [c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=16, temperature=0.9,
                                  top_p=0.95, seed=seed).choices[0].text for p in PROMPTS[:2]]
    SEEDED[fleet.name] = texts
    for other in SEEDED.values():
        assert other == texts


BAD = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": "hi", "model": "nope"}'),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}'),
]


def test_bad_input_same_as_instance(fleet):
    instance = fleet.fleet.instances()[-1][2]  # the last: a decode (or colocated) instance
    for path, body in BAD:
        via_router = httpx.post(fleet.url + path, content=body,
                                headers={"content-type": "application/json"})
        direct = httpx.post(instance + path, content=body,
                            headers={"content-type": "application/json"})
        assert via_router.status_code == direct.status_code, (path, body)
        assert via_router.status_code in (400, 404)
        assert via_router.json() == direct.json(), (path, body)


def test_health_lists_instances(fleet):
    client(fleet).completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8)
    wait_all_blocks_free(fleet)  # asked of each instance directly
    health = httpx.get(f"{fleet.url}/health").json()
    assert health["status"] == "ok"
    assert {i["url"] for i in health["instances"]} == {u for *_, u in fleet.fleet.instances()}
    assert all(i["healthy"] for i in health["instances"])
    # The router checks every instance on /health: its figures are those of now, not of the
    # last background poll (which may predate the request's end).
    for inst in health["instances"]:
        assert inst["kv_blocks_free"] == inst["kv_blocks_total"] > 0, inst
        assert inst["running"] == inst["waiting"] == 0, inst
    metrics = httpx.get(f"{fleet.url}/metrics").text
    assert "splitserve:router_requests_total" in metrics


def test_tokenize_and_detokenize_through_the_router(fleet):
    instance = fleet.fleet.instances()[-1][2]
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0]}
    via_router = httpx.post(f"{fleet.url}/tokenize", json=body)
    assert via_router.status_code == 200
    assert via_router.json() == httpx.post(f"{instance}/tokenize", json=body).json()
    tokens = via_router.json()["tokens"]
    back = httpx.post(f"{fleet.url}/detokenize", json={"tokens": tokens})
    assert back.status_code == 200 and back.json()["prompt"] == PROMPTS[0]
    bad = httpx.post(f"{fleet.url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tokens")
