"""The instance server's error answers: every bad request is an OpenAI error body with a status
that names whose fault it is (400 naming the field, 404, 413, 503), and none hurts the server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_helpers import MAX_BODY_BYTES, MAX_MODEL_LEN, Server, prompt
from testutil import assert_all_blocks_free

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
     400, "kv_transfer_params"),
    ("/v1/completions", {"prompt": [5, 6, 7], "n": 2, "num_prior_output_tokens": 1}, 400,
     "num_prior_output_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, 400, None),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, 400, None),
    ("/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 10)}, 400, None),
    ("/v1/completions", {"prompt": [7] * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [5, 10**8]}, 400,
     "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_request(server: Server, path, body, status, param, stream):
    r = httpx.post(server.url + path, json={**body, "stream": stream}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
        assert param in error["message"] or status == 404
    assert server.health()["status"] == "ok"


@pytest.mark.parametrize(
    "raw,content_type",
    [
        (b"{not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"", "application/json"),
        (b"\xff\xfe", "text/plain"),
    ],
)
def test_invalid_json(server: Server, raw: bytes, content_type: str):
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=raw,
        headers={"content-type": content_type},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert server.health()["status"] == "ok"


def test_body_too_large(server: Server):
    big = {"prompt": "x" * (MAX_BODY_BYTES + 10)}
    r = httpx.post(f"{server.url}/v1/completions", json=big, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted while reading
        yield json.dumps(big).encode()

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=10)
    assert r.status_code == 413
    assert server.health()["status"] == "ok"


def test_unknown_route_is_openai_error(server: Server):
    r = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_queue_full_is_503(server: Server):
    """4 may run and 6 wait: of 20 simultaneous requests some must be refused with 503."""

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(
                *(
                    c.post(
                        f"{server.url}/v1/completions",
                        json={"prompt": prompt(8, i), "max_tokens": 60, "ignore_eos": True},
                    )
                    for i in range(20)
                )
            )
        for r in rs:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "queue_full"
        return [r.status_code for r in rs]

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses
    assert_all_blocks_free(server.wait_idle())
