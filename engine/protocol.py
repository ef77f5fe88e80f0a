"""OpenAI-compatible HTTP messages, shared by the instance server and the router.

Requests accept OpenAI's fields plus vLLM's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `priority`,
`kv_transfer_params`, `return_token_ids`), so clients written for vLLM work unchanged (the `openai`
client sends the extensions through `extra_body`). Range checks live on the fields, so a bad
value is a 400 that names the field, never a 500 from deeper down. Unknown fields are ignored, as
OpenAI and vLLM do.

Response bodies, chunks and errors live in protocol_responses.py and are re-exported here, so
this module stays the one import of the HTTP message types. The router only reads and writes these
models; it never imports the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt, ValidationInfo, field_validator

from splitserve.engine.protocol_responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChoiceBase,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIModel,
    PromptTokensDetails,
    ResponseBase,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)

TokenIds = list[NonNegativeInt]

__all__ = [
    "ChatCompletionChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "ChoiceBase",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "KVReleaseRequest",
    "ModelCard",
    "ModelList",
    "OpenAIModel",
    "PromptTokensDetails",
    "ResponseBase",
    "ResponseFormatSpec",
    "SamplingFields",
    "StreamOptions",
    "TextContentPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "TopLogprob",
    "UsageInfo",
    "deliverable_text_len",
]


# ------------------------------------------------------------------------------------ requests
class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """Send one last chunk with `usage` (and no choices) before `[DONE]`."""
    continuous_usage_stats: bool = False
    """vLLM: put the running `usage` on every chunk."""

def split_prompts(prompt: Any) -> list[Any]:
    """A completion's `prompt` as a list of prompts: a text or one token-id list is one prompt,
    a list of texts or of token-id lists is several (the router splits a raw body the same way)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


MAX_N = 128
"""Most choices per prompt (`n`): each is an engine request in the waiting queue."""


class ResponseFormatSpec(OpenAIModel):
    type: Literal["text"]


class SamplingFields(OpenAIModel):
    """Fields common to completions and chat completions (OpenAI + vLLM extensions)."""

    model: str | None = None
    """Served model name; omitted means the instance's only model."""
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    """0 or -1 disable top-k."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    """Choices per prompt (parallel sampling): each is its own engine request; with a `seed`,
    choice j samples with `seed + j` (vLLM's rule)."""
    best_of: Literal[1] | None = None
    """Only one candidate per prompt is generated."""
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    """Token id (a JSON string key, as OpenAI sends it) → added to its logit before sampling."""
    allowed_token_ids: TokenIds | None = Field(default=None, min_length=1)
    """Sample only among these tokens (vLLM)."""
    response_format: ResponseFormatSpec | None = None
    """Only plain text: structured output (`json_object`, `json_schema`) is refused with a 400
    rather than ignored, since a client asking for JSON must not get free text silently."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    """Waiting-queue priority under the `priority` policy: lower runs first (vLLM)."""
    kv_transfer_params: dict[str, Any] | None = None
    """Passed to the engine's KV connector; the connector's answer comes back at top level."""
    return_token_ids: bool = False
    """Add `prompt_token_ids` and `token_ids` to each choice (vLLM); the P/D router uses it."""

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def deliverable_text_len(text: str, stop: list[str], include_stop_str_in_output: bool) -> int:
    """How much of an unfinished output's `text` a client may already see.

    Everything but the longest ending of `text` that begins a stop string: should that string
    complete later, the text is cut where it starts, and a streamed prefix cannot be taken back.
    (With `include_stop_str_in_output` nothing is cut, so nothing is held.) Streaming instances
    release text by this rule, and the P/D router sends t0's text by it, so t0's held part comes
    from the decode instance, which primes its output with t0 (`num_prior_output_tokens`).
    """
    if not stop or include_stop_str_in_output:
        return len(text)
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return len(text) - held


PromptInput = Annotated[
    str | list[str] | TokenIds | list[TokenIds],
    Field(description="text, token ids, or a batch of either"),
]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Top logprobs per position (the sampled token's is always included)."""
    echo: Literal[False] = False
    """Echoing the prompt is not supported."""
    suffix: None = None
    """Not supported."""
    num_prior_output_tokens: NonNegativeInt = 0
    """The last k tokens of each prompt are output this request already generated elsewhere (the
    t0 a prefill instance sampled, which the P/D router sends a decode instance with the prompt).
    They count as output, as in a colocated run: penalties, `min_tokens`/`max_tokens`, the seeded
    position, stop strings spanning them and what follows, `usage.completion_tokens`. The answer
    carries only what follows them: its text starts at `deliverable_text_len` of theirs."""

    @field_validator("prompt")
    @classmethod
    def _prompt_non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list | str) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, text or token ids."""
        return split_prompts(self.prompt)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    """Deprecated by OpenAI in favour of `max_completion_tokens`; either is accepted."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = Field(default=None, validate_default=True)

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_calls(cls, v: Any, info: ValidationInfo) -> Any:
        """Tool calls need a tool-call parser, which this server does not have: refuse them
        (400) instead of answering in free text; tools with `tool_choice: "none"` are ignored."""
        if info.data.get("tools") and v != "none":
            raise ValueError("tool calling is not supported by this server; with tools, send "
                             "tool_choice \"none\" to have them ignored")
        if v not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported by this server")
        return v

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class KVReleaseRequest(OpenAIModel):
    """`POST /v1/kv/release`: free what a request holds for a consumer. Either the
    `kv_transfer_params` this instance returned for it, or the `request_id` (the X-Request-Id)
    it came with, for a caller that gave up before the answer arrived."""

    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = Field(default=None, min_length=1, validate_default=True)

    @field_validator("request_id")
    @classmethod
    def _one_input(cls, v: str | None, info: ValidationInfo) -> Any:
        if (v is None) == (info.data.get("kv_transfer_params") is None):
            raise ValueError("send either kv_transfer_params or request_id")
        return v


class TokenizeRequest(OpenAIModel):
    """`POST /tokenize` (vLLM): a text prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, validate_default=True)
    add_special_tokens: bool = True
    """Text prompts only, as `/v1/completions` encodes them; chat text is templated instead."""
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _one_input(cls, v: list[ChatMessage] | None, info: ValidationInfo) -> Any:
        if (v is None) == (info.data.get("prompt") is None):
            raise ValueError("send either prompt or messages")
        return v


class DetokenizeRequest(OpenAIModel):
    """`POST /detokenize` (vLLM)."""

    model: str | None = None
    tokens: TokenIds
