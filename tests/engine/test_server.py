"""The OpenAI-compatible instance server, as a real process started with the CLI.

One server per module (config file + overriding flags); tests talk to it with the `openai` client
and httpx. The last test stops it with SIGTERM and checks that no process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from testutil import assert_all_blocks_free

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_WAITING = 6
MAX_BODY_BYTES = 64 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli() -> list[str]:
    exe = shutil.which("splitserve")
    return [exe] if exe else [sys.executable, "-m", "splitserve.cli"]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, model: str) -> None:
        self.proc, self.port, self.log, self.model = proc, port, log, model
        self.url = f"http://127.0.0.1:{port}"

    def health(self) -> dict:
        r = httpx.get(f"{self.url}/health", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """/health once nothing runs or waits (aborts reach the core asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(llama_fp32: str, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("server")
    config = tmp / "instance.yaml"
    config.write_text(
        f"engine:\n"
        f"  model: {{model: {llama_fp32}, max_model_len: {MAX_MODEL_LEN}}}\n"
        f"  cache: {{kv_cache_memory: 32MiB, block_size: 16}}\n"
        f"  scheduler: {{max_num_seqs: 64}}\n"
        f"  num_threads: 1\n"
        f"server:\n"
        f"  port: 1\n"  # overridden by --port below
        f"  max_body_bytes: {MAX_BODY_BYTES}\n"
        f"  max_waiting: {MAX_WAITING}\n"
        f"  role: colocated\n"
    )
    port = _free_port()
    log = tmp / "server.log"
    cmd = _cli() + [
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--log-level",
        "warning",
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    srv = Server(proc, port, log, Path(llama_fp32).name)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after 180 s:\n{log.read_text()}")
        time.sleep(0.2)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_fp32: str):
    from splitserve import LLM

    llm = LLM(llama_fp32, kv_cache_memory="16MiB", num_threads=1, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 8000 + 10 for i in range(n)]


# ------------------------------------------------------------------------------------ success
def test_models_and_health(server: Server, client: openai.OpenAI):
    assert [m.id for m in client.models.list().data] == [server.model]
    h = server.health()
    assert h["status"] == "ok" and h["role"] == "colocated" and h["model"] == server.model
    assert h["kv_blocks_total"] > 0 and h["kv_blocks_free"] == h["kv_blocks_total"]


def test_completion_and_usage(server: Server, client: openai.OpenAI):
    r = client.completions.create(
        model=server.model,
        prompt="def main(",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_completion(server: Server, client: openai.OpenAI):
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == 5
    assert len(choice.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_streaming_equals_non_streaming(server: Server, client: openai.OpenAI):
    kwargs = dict(
        model=server.model,
        prompt=_prompt(20),
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 20


def test_streaming_chat_with_usage(server: Server, client: openai.OpenAI):
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_greedy_equals_offline_llm(server: Server, offline):
    from splitserve import SamplingParams

    prompts = [_prompt(n, seed) for seed, n in enumerate([1, 5, 17, 40, 100])]
    expected = offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    # One request with a batch of token-id prompts: one choice per prompt, index = prompt index.
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "prompt": prompts,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()
    assert [c["index"] for c in r["choices"]] == list(range(len(prompts)))
    for choice, exp, prompt in zip(r["choices"], expected, prompts, strict=True):
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == exp.outputs[0].token_ids
        assert choice["text"] == exp.outputs[0].text
    assert r["usage"]["completion_tokens"] == 16 * len(prompts)


def test_raw_responses_match_protocol_models(server: Server):
    """What the router will parse: every body and chunk validates against engine/protocol.py."""
    from splitserve.engine import protocol as p

    cases = [
        ("/v1/completions", {"prompt": "a"}, p.CompletionResponse, p.CompletionStreamResponse),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}]},
            p.ChatCompletionResponse,
            p.ChatCompletionStreamResponse,
        ),
    ]
    for path, body, full_model, chunk_model in cases:
        body = {**body, "max_tokens": 3, "logprobs": True if "messages" in body else 1}
        full_model.model_validate(httpx.post(server.url + path, json=body, timeout=30).json())
        with httpx.stream(
            "POST",
            server.url + path,
            timeout=30,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [chunk_model.model_validate_json(d) for d in data[:-1]]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_stop_string(server: Server, client: openai.OpenAI):
    kwargs = dict(model=server.model, prompt=_prompt(9, 3), max_tokens=24, temperature=0)
    text = client.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    expected = text[: text.index(stop)]
    r = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **kwargs)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(stop=stop, stream=True, extra_body={"ignore_eos": True}, **kwargs)
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert_all_blocks_free(server.wait_idle())


def test_seed_reproducible(server: Server, client: openai.OpenAI):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=server.model,
                prompt="import os",
                max_tokens=16,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"ignore_eos": True, "top_k": 50},
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_logprobs_request_id_and_transfer_params(server: Server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers={"X-Request-Id": "abc123"},
        json={
            "prompt": _prompt(8),
            "max_tokens": 4,
            "logprobs": 3,
            "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": False},
            "priority": 1,
        },
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc123"
    body = r.json()
    assert body["id"] == "cmpl-abc123" and "kv_transfer_params" in body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
    assert all(len(top) >= 3 for top in lp["top_logprobs"])


# ------------------------------------------------------------------------------------ errors
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, 400, None),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, 400, None),
    ("/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 10)}, 400, None),
    ("/v1/completions", {"prompt": [7] * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
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
                        json={"prompt": _prompt(8, i), "max_tokens": 60, "ignore_eos": True},
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


# ------------------------------------------------------------------------------------ lifecycle
def _generated_tokens(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("splitserve:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no splitserve:generation_tokens_total")


def test_client_disconnect_frees_blocks(server: Server):
    before = _generated_tokens(server)
    with httpx.Client(timeout=30) as c:
        for _ in range(2):
            with c.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={"prompt": _prompt(50), "max_tokens": 900, "ignore_eos": True, "stream": True},
            ) as r:
                lines = r.iter_lines()
                got: list[str] = []
                for line in lines:
                    if line.startswith("data:"):
                        got.append(line)
                    if len(got) >= 3:
                        break
                assert len(got) == 3
    h = server.wait_idle()
    assert h["running"] == 0 and h["waiting"] == 0
    assert_all_blocks_free(h)
    # Aborted, not run to the end: far fewer than 2 x 900 tokens were generated.
    assert _generated_tokens(server) - before < 900


def test_metrics(server: Server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "splitserve:time_to_first_token_seconds_bucket",
        "splitserve:inter_token_latency_seconds_bucket",
        "splitserve:e2e_request_latency_seconds_count",
        "splitserve:num_requests_running",
        "splitserve:num_requests_waiting",
        "splitserve:kv_cache_usage_perc",
        "splitserve:prefix_cache_hit_rate",
        "splitserve:prompt_tokens_total",
        "splitserve:generation_tokens_total",
    ):
        assert name in text, name


def test_bad_config_exits_2(tmp_path: Path, llama_fp32: str):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"engine:\n  model: {{model: {llama_fp32}}}\n  cache: {{block_size: 7}}\n")
    r = subprocess.run(
        _cli() + ["serve", "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "engine.cache.block_size" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_exits_cleanly(server: Server):
    """Last test of the module: it stops the shared server."""
    children = _children(server.proc.pid)
    assert children, "the engine-core process should be a child of the server"
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=10) == 0, server.log.read_text()
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if _alive(p)], "left-over child processes"
