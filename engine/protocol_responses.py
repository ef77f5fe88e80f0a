"""OpenAI-compatible response bodies, stream chunks and errors (the models' half of protocol.py).

`splitserve.engine.protocol` re-exports every name here, so callers import one module. The server
writes these shapes as plain dicts (pydantic per token would cost more than the rest of the front
end); the models are what the router and the tests parse the bytes with.

OpenAI gives a streamed chunk the same shape as a full answer except where it cannot: a completion
chunk is a completion answer whose `usage` may be absent, and a chat chunk carries a `delta`
where the answer carries a `message`. The models share exactly that much.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    """Base of every message: unknown fields are ignored, as OpenAI and vLLM do."""

    model_config = ConfigDict(extra="ignore")


def _now() -> int:
    return int(time.time())


# ------------------------------------------------------------------------------------ errors
class ErrorInfo(OpenAIModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI answers."""

    error: ErrorInfo


# ------------------------------------------------------------------------------------ shared parts
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChoiceBase(OpenAIModel):
    """What every choice carries, streamed or not, completion or chat."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM: the stop string or token id that ended the choice."""
    token_ids: list[int] | None = None
    """vLLM `return_token_ids`: the tokens of this choice (of this chunk, when streamed)."""


class ResponseBase(OpenAIModel):
    """What every body and chunk carries besides its `object`, `choices` and `usage`."""

    id: str
    created: int = Field(default_factory=_now)
    model: str
    kv_transfer_params: dict[str, Any] | None = None
    """The KV connector's answer (a prefill instance's blocks), on the last chunk when streamed."""


# ------------------------------------------------------------------------------------ completions
class CompletionLogprobs(OpenAIModel):
    """Completions' logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ChoiceBase):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = None


CompletionStreamChoice = CompletionChoice
"""A streamed completion choice has the answer's shape (`text` is the chunk's new text)."""


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(CompletionResponse):
    """A completion chunk: `usage` only on the last chunk (`include_usage`) or on every one
    (`continuous_usage_stats`)."""

    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------ chat
class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None


class ChatResponseMessage(DeltaMessage):
    role: str = "assistant"


class ChatChoiceBase(ChoiceBase):
    logprobs: ChatLogprobs | None = None


class ChatCompletionChoice(ChatChoiceBase):
    message: ChatResponseMessage


class ChatCompletionStreamChoice(ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class ChatCompletionStreamResponse(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """On the first (role) chunk only, with `return_token_ids`."""


# ------------------------------------------------------------------------------------ models
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "splitserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    """`POST /tokenize` (vLLM's shape)."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    """`POST /detokenize` (vLLM's shape)."""

    prompt: str
