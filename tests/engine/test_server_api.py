"""The instance server's routes on good requests: completions and chat (streamed or not), usage,
logprobs, stop strings, seeds, greedy parity with the offline LLM, response shapes, metrics.

One real server for the module (conftest.py), driven with the `openai` client and httpx.
"""

from __future__ import annotations

import httpx
import openai
from server_helpers import Server, prompt
from testutil import assert_all_blocks_free


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
        prompt=prompt(20),
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

    prompts = [prompt(n, seed) for seed, n in enumerate([1, 5, 17, 40, 100])]
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
    for choice, exp, ids in zip(r["choices"], expected, prompts, strict=True):
        assert choice["prompt_token_ids"] == ids
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
    kwargs = dict(model=server.model, prompt=prompt(9, 3), max_tokens=24, temperature=0)
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
            "prompt": prompt(8),
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


def test_tokenize_and_detokenize(server: Server, client: openai.OpenAI):
    """vLLM's /tokenize counts what a request would be prompted with: a text prompt as
    /v1/completions encodes it, chat messages through the template (usage agrees)."""
    url = server.url
    text = "def main():\n    return 42"
    tok = httpx.post(f"{url}/tokenize", json={"model": server.model, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text
    usage = client.completions.create(model=server.model, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == tok["count"]
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    usage = client.chat.completions.create(model=server.model, messages=messages,
                                           max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]
    for path, body, param in (("/tokenize", {}, "messages"),
                              ("/tokenize", {"prompt": "x", "messages": messages}, "messages"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens")):
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    r = httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


def test_n_choices_seeded_per_choice_and_usage(server: Server, client: openai.OpenAI):
    """`n`: choice j of prompt i is at index i * n + j and samples as a one-choice request with
    `seed + j` would; a prompt's tokens count once in the usage; streamed equals not. (Few
    tokens: a batch's numerics differ from a lone request's in the last bits, enough to flip a
    near-tie draw now and then.)"""
    params = {"model": server.model, "max_tokens": 4, "temperature": 1.0, "seed": 40,
              "extra_body": {"ignore_eos": True}}
    prompts = ["import os", "def main("]
    r = client.completions.create(prompt=prompts, n=2, **params)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        for j in range(2):
            alone = client.completions.create(prompt=p, **{**params, "seed": 40 + j})
            assert r.choices[i * 2 + j].text == alone.choices[0].text, (i, j)
    singles = [client.completions.create(prompt=p, **params).usage for p in prompts]
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert r.usage.completion_tokens == 4 * 4

    streamed: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True,
                                           stream_options={"include_usage": True}, **params):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert streamed == {c.index: c.text for c in r.choices}
    assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_n_choices_streamed_and_not(server: Server, client: openai.OpenAI):
    params = {"model": server.model, "messages": [{"role": "user", "content": "hello"}],
              "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 3,
              "extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(**params)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seeds 3, 4, 5 differ
    assert r.usage.completion_tokens == 15
    roles, texts = set(), {}
    for chunk in client.chat.completions.create(stream=True, **params):
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0, 1, 2}
    assert texts == {c.index: c.message.content for c in r.choices}
    assert_all_blocks_free(server.wait_idle())
