"""A 1P1D fleet answers exactly as a colocated instance: the decode instance counts the prefill
instance's t0 as output (`num_prior_output_tokens`), not as prompt.

Both fleets run at once; each case goes to both, streamed and not, and everything a client sees
must match: text, token ids, finish and stop reasons, logprobs, usage. The cases are ones where
t0's place matters: presence/frequency/repetition penalties (greedy and seeded), min_tokens
masking a stop token at t1, and a stop string that starts in t0's text and ends in t1's.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from fleet_helpers import MODEL_NAME, start_fleet, wait_all_blocks_free

PROMPT = "import os\nimport sys\n"


@pytest.fixture(scope="module")
def fleets(llama_fp32, tmp_path_factory):
    started = {}
    try:
        for name in ("colocated", "1p1d-nixl"):
            started[name] = start_fleet(name, llama_fp32, tmp_path_factory.mktemp(name))
        yield started
    finally:
        for running in started.values():
            running.stop()


def _client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60)


def _complete(fleet, stream: bool, prompt: str, **params: Any) -> dict[str, Any]:
    """What the client got, streamed or not, in one shape."""
    extra = {
        k: params.pop(k)
        for k in (
            "repetition_penalty",
            "min_tokens",
            "stop_token_ids",
            "include_stop_str_in_output",
            "allowed_token_ids",
        )
        if k in params
    }
    extra["return_token_ids"] = True
    kwargs = {"model": MODEL_NAME, "prompt": prompt, "extra_body": extra, **params}
    got: dict[str, Any] = {"text": "", "token_ids": [], "tokens": [], "logprobs": [], "offsets": []}
    if stream:
        chunks = _client(fleet).completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        for chunk in chunks:
            if chunk.usage:
                got["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                _add_choice(got, choice)
    else:
        answer = _client(fleet).completions.create(**kwargs)
        _add_choice(got, answer.choices[0])
        got["usage"] = (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    return got


def _add_choice(got: dict[str, Any], choice: Any) -> None:
    got["text"] += choice.text
    got["token_ids"] += getattr(choice, "token_ids", None) or []
    if choice.finish_reason is not None:
        got["finish"] = (choice.finish_reason, getattr(choice, "stop_reason", None))
    if choice.logprobs is not None:
        got["tokens"] += choice.logprobs.tokens
        got["logprobs"] += choice.logprobs.token_logprobs
        got["offsets"] += choice.logprobs.text_offset


def _assert_same(fleets, prompt: str, **params: Any) -> dict[str, Any]:
    """Colocated (not streamed) is the reference; 1P1D, streamed and not, must equal it."""
    want = _complete(fleets["colocated"], False, prompt, **params)
    assert _complete(fleets["colocated"], True, prompt, **params) == want
    for stream in (False, True):
        got = _complete(fleets["1p1d-nixl"], stream, prompt, **params)
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), stream
        got["logprobs"] = want["logprobs"]
        assert got == want, f"stream={stream}"
    for fleet in fleets.values():
        wait_all_blocks_free(fleet)
    return want


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        (
            "def main():",
            {
                "temperature": 0,
                "presence_penalty": -2.0,
                "frequency_penalty": -2.0,
                "repetition_penalty": 1.1,
                "logprobs": 2,
            },
        ),
        (
            PROMPT,
            {
                "temperature": 0.9,
                "top_p": 0.95,
                "seed": 7,
                "presence_penalty": 1.0,
                "frequency_penalty": 1.0,
                "repetition_penalty": 1.1,
                "logprobs": 0,
            },
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_penalties_and_seeded_sampling(fleets, prompt, params):
    want = _assert_same(fleets, prompt, max_tokens=16, **params)
    assert want["usage"][1] == len(want["token_ids"]) == 16


def test_logit_bias_and_allowed_token_ids_reach_prefill_and_decode(fleets):
    want = _assert_same(fleets, PROMPT, max_tokens=10, temperature=0.8, seed=11,
                        allowed_token_ids=[20, 21, 22, 23], logit_bias={"23": -100, "20": 2})
    assert set(want["token_ids"]) <= {20, 21, 22}


def test_min_tokens_masks_a_stop_token_at_t1(fleets):
    plain = _complete(fleets["colocated"], False, PROMPT, max_tokens=8, temperature=0)
    params = {
        "max_tokens": 8,
        "temperature": 0,
        "min_tokens": 3,
        "stop_token_ids": [plain["token_ids"][1]],
    }
    want = _assert_same(fleets, PROMPT, **params)
    assert want["token_ids"][1] != plain["token_ids"][1]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_t0_and_t1(fleets, include):
    greedy = {"temperature": 0, "max_tokens": 8}
    full = _complete(fleets["colocated"], False, PROMPT, **greedy)["text"]
    t0 = _complete(fleets["colocated"], False, PROMPT, **{**greedy, "max_tokens": 1})["text"]
    stop = full[len(t0) - 2 : len(t0) + 2]
    assert len(t0) >= 2 and len(stop) == 4 and full.index(stop) == len(t0) - 2
    want = _assert_same(
        fleets, PROMPT, stop=[stop], include_stop_str_in_output=include, logprobs=1, **greedy
    )
    assert want["finish"] == ("stop", stop)
    assert want["text"] == full[: len(t0) + 2 if include else len(t0) - 2]
    assert want["usage"][1] == 2


def test_chat_with_penalties_and_a_seed(fleets):
    msgs = [{"role": "user", "content": "Name three caches."}]
    params = {
        "model": MODEL_NAME,
        "messages": msgs,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 3,
        "presence_penalty": 1.0,
        "frequency_penalty": -1.0,
    }
    answers = []
    for name in ("colocated", "1p1d-nixl"):
        full = _client(fleets[name]).chat.completions.create(**params)
        stream = _client(fleets[name]).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **params
        )
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        usage = next(ch.usage for ch in chunks if ch.usage)
        assert text == full.choices[0].message.content
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            full.usage.prompt_tokens,
            full.usage.completion_tokens,
        )
        answers.append((text, full.usage.prompt_tokens, full.usage.completion_tokens))
    assert answers[0] == answers[1]
    for fleet in fleets.values():
        wait_all_blocks_free(fleet)


def _batch(fleet, stream: bool, prompts: list, **params: Any) -> dict[str, Any]:
    """Per choice index: (text, token ids, finish reason); and the usage."""
    kwargs = {
        "model": MODEL_NAME,
        "prompt": prompts,
        "extra_body": {"return_token_ids": True},
        **params,
    }
    got: dict[int, dict[str, Any]] = {
        i: {"text": "", "token_ids": [], "tokens": [], "logprobs": [], "offsets": []}
        for i in range(len(prompts))
    }
    if stream:
        chunks = list(
            _client(fleet).completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        usage = [ch.usage for ch in chunks if ch.usage]
        assert len(usage) == 1 and all(not ch.choices for ch in chunks if ch.usage)
        usage = usage[0]
        choices = [c for ch in chunks for c in ch.choices]
    else:
        answer = _client(fleet).completions.create(**kwargs)
        usage, choices = answer.usage, answer.choices
    for c in choices:
        _add_choice(got[c.index], c)
    return {"choices": got, "usage": (usage.prompt_tokens, usage.completion_tokens)}


@pytest.mark.parametrize(
    "prompts",
    [[PROMPT, "def main():", "x = 1"], [[5, 6, 7, 8], [9, 10]]],
    ids=["text", "token-ids"],
)
def test_batched_prompts_go_through_prefill_and_decode(fleets, prompts):
    params = {
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "presence_penalty": 1.0,
        "frequency_penalty": -1.0,
        "logprobs": 1,
    }
    want = _batch(fleets["colocated"], False, prompts, **params)
    assert all(len(c["token_ids"]) == 12 for c in want["choices"].values())
    prefills = _prefill_requests(fleets["1p1d-nixl"])
    for stream in (False, True):
        got = _batch(fleets["1p1d-nixl"], stream, prompts, **params)
        for i, choice in got["choices"].items():
            assert choice["logprobs"] == pytest.approx(want["choices"][i]["logprobs"], abs=1e-4)
            choice["logprobs"] = want["choices"][i]["logprobs"]
        assert got == want, stream
    assert _prefill_requests(fleets["1p1d-nixl"]) == prefills + 2 * len(prompts)
    for fleet in fleets.values():
        wait_all_blocks_free(fleet)


def _prefill_requests(fleet) -> float:
    """Requests the prefill instance finished (its Prometheus counter)."""
    url = next(u for role, _, u in fleet.fleet.instances() if role == "prefill")
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("splitserve:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_bad_prompt_in_a_batch_fails_it_like_an_instance(fleets):
    body = {"model": MODEL_NAME, "prompt": [[5, 6, 7], [10**6]], "max_tokens": 4}
    answers = [
        httpx.post(f"{fleets[name].url}/v1/completions", json=body, timeout=60)
        for name in ("colocated", "1p1d-nixl")
    ]
    assert answers[0].status_code == answers[1].status_code == 400
    assert answers[0].json() == answers[1].json()
    for fleet in fleets.values():
        wait_all_blocks_free(fleet)


def test_cached_tokens_are_the_prefill_instances_prefix_hits(fleets):
    """`usage.prompt_tokens_details.cached_tokens` through P/D is P's prefix-cache hit, as
    colocated: a repeated prompt reports its cached full blocks, a fresh one 0 (the KV that D
    loads from P is a transfer, not a cache hit)."""
    prompt = [(7 * i) % 200 + 3 for i in range(40)]  # token ids: 2 full blocks of 16 and 8 more
    for name in ("colocated", "1p1d-nixl"):
        cached = []
        for _ in range(2):
            answer = _client(fleets[name]).completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, 32], name
        wait_all_blocks_free(fleets[name])


def _choices(fleet, chat: bool, stream: bool, **params: Any) -> tuple[dict, tuple]:
    """{index: (text, finish_reason)} and (prompt, completion) usage, streamed or not."""
    client = _client(fleet)
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        r = create(**params)
        return ({c.index: (c.message.content if chat else c.text, c.finish_reason)
                 for c in r.choices}, (r.usage.prompt_tokens, r.usage.completion_tokens))
    texts, finish, usage = {}, {}, None
    for chunk in create(stream=True, stream_options={"include_usage": True}, **params):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + ((c.delta.content or "") if chat else c.text)
            finish[c.index] = c.finish_reason or finish.get(c.index)
        if chunk.usage:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return {k: (texts[k], finish[k]) for k in sorted(texts)}, usage


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_choices_through_pd_equal_colocated(fleets, chat):
    """`n` > 1 (with a batch of prompts for completions): the router sends every choice through
    P and D on its own (`n: 1`, `seed + j`); the answer equals a colocated instance's."""
    params: dict[str, Any] = {"model": MODEL_NAME, "n": 3, "max_tokens": 4, "temperature": 1.0,
                              "seed": 9}
    if chat:
        params["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        params["prompt"] = [PROMPT, "def main():"]
    want = _choices(fleets["colocated"], chat, False, **params)
    assert sorted(want[0]) == list(range(3 if chat else 6))
    assert len({text for text, _ in want[0].values()}) > 1
    for stream in (False, True):
        assert _choices(fleets["1p1d-nixl"], chat, stream, **params) == want, stream
    wait_all_blocks_free(fleets["1p1d-nixl"])
