"""OpenAI message models: prompt forms, field validation that names the field, defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionStreamResponse,
    ErrorResponse,
)


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts == expected


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
        ({"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options"),
    ],
)
def test_completion_validation_names_the_field(fields, name):
    with pytest.raises(ValidationError) as info:
        CompletionRequest(**fields)
    assert all(str(e["loc"][0]) == name for e in info.value.errors())


def test_chat_request_fields():
    req = ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        max_completion_tokens=7,
        logprobs=True,
        top_logprobs=3,
        stream_options={"include_usage": True},
        unknown_field=1,
    )
    assert req.messages[0].text == "ab"
    assert req.max_output_tokens == 7 and req.num_logprobs == 3 and req.include_usage
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).num_logprobs is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])


def test_vllm_extensions_and_defaults():
    req = CompletionRequest(
        prompt="x", kv_transfer_params={"do_remote_decode": True}, priority=-1, stop="END"
    )
    assert req.max_tokens == 16 and req.temperature == 1.0 and req.stop_list == ["END"]
    assert req.kv_transfer_params == {"do_remote_decode": True} and req.priority == -1


def test_response_shapes_parse():
    err = ErrorResponse.model_validate(
        {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    )
    assert err.error.message == "m"
    chunk = CompletionStreamResponse.model_validate(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
        }
    )
    assert chunk.choices[0].text == "a" and chunk.usage is None
