"""RequestOutputs as OpenAI JSON: the full body of an answer, or its SSE chunks as they come.

One formatter per HTTP request, completion or chat (they differ in the choice and the logprobs
shape, and chat opens its stream with a role chunk). Bodies and chunks are plain dicts encoded by
msgspec, shaped as the models of protocol_responses.py: pydantic per token would cost more than
the rest of the front end together.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from splitserve.engine.output_processor import RequestOutput
from splitserve.engine.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from splitserve.engine.request import TokenLogprobs
from splitserve.engine.streaming import sse
from splitserve.engine.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(outputs: list[RequestOutput], n: int = 1) -> dict[str, Any]:
    """Prior output (`num_prior_output_tokens`) counts as completion, not prompt: the usage of
    a decode instance's answer is that of the whole request, as a colocated run reports it.
    `outputs` are in choice order, `n` per prompt: a prompt counts once (as OpenAI and vLLM
    count it), from its first choice."""
    firsts = outputs[::n]
    return usage(
        sum(len(o.prompt_token_ids) for o in firsts),
        sum(o.num_output_tokens for o in outputs),
        sum(o.num_cached_tokens for o in firsts),
    )


class ResponseFormat(ABC):
    """What completions and chat share: the header of every body and chunk, the chunk of a
    streamed update (usage, `kv_transfer_params`), the final usage chunk, token strings."""

    object_name: str
    """`object` of the full answer."""
    chunk_object_name: str
    """`object` of a streamed chunk."""

    def __init__(
        self, req: SamplingFields, rid: str, model_name: str, tokenizer: Tokenizer
    ) -> None:
        self.req, self.rid, self.model_name, self.tokenizer = req, rid, model_name, tokenizer
        # Read per chunk: plain attributes, not the request model's properties.
        self.include_usage, self.continuous_usage = req.include_usage, req.continuous_usage
        self.n = req.n
        self._chunk_header: dict[str, Any] | None = None  # set by the first streamed update
        self._finals: dict[int, RequestOutput] = {}  # choice index → its last update

    def header(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": object_name,
            "created": int(time.time()),
            "model": self.model_name,
        }

    @abstractmethod
    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed answer to every prompt of the request."""

    @abstractmethod
    def stream_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """The choice of one streamed update of prompt `index`."""

    def opening_chunks(self, header: dict[str, Any], out: RequestOutput) -> list[dict[str, Any]]:
        """Chunks sent before the first update's own (none, unless the endpoint says so)."""
        return []

    def stream_events(self, index: int, out: RequestOutput) -> bytes:
        """The SSE events of one streamed update of prompt `index` (the first update of the
        answer also opens the stream); `kv_transfer_params` go on a prompt's last chunk."""
        data = b""
        header = self._chunk_header
        if header is None:
            header = self._chunk_header = self.header(self.chunk_object_name)
            data = b"".join(sse(chunk) for chunk in self.opening_chunks(header, out))
        chunk = {**header, "choices": [self.stream_choice(index, out)]}
        if self.continuous_usage:
            chunk["usage"] = usage_of([out])
        if out.finished:
            self._finals[index] = out
            if out.kv_transfer_params is not None:
                chunk["kv_transfer_params"] = out.kv_transfer_params
        return data + sse(chunk)

    def stream_end(self) -> bytes:
        """The events after every prompt's last update: the usage chunk, if asked for."""
        if not self.include_usage or self._chunk_header is None:
            return b""
        usage = usage_of([self._finals[i] for i in sorted(self._finals)], self.n)
        return sse({**self._chunk_header, "choices": [], "usage": usage})

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text_len(self, token_ids: list[int]) -> int:
        return sum(len(self.token_str(t)) for t in token_ids)


class CompletionFormat(ResponseFormat):
    object_name = chunk_object_name = "text_completion"
    req: CompletionRequest

    def __init__(
        self, req: CompletionRequest, rid: str, model_name: str, tokenizer: Tokenizer
    ) -> None:
        super().__init__(req, rid, model_name, tokenizer)
        self.offsets: dict[int, int] = {}  # per prompt: text_offset of its next streamed token

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choice = {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": self.logprobs(
                    c.token_ids, c.logprobs, self.text_len(out.prior_output_token_ids)
                ),
            }
            if self.req.return_token_ids:
                choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            choices.append(choice)
        return {
            **self.header(self.object_name),
            "choices": choices,
            "usage": usage_of(outs, self.n),
            "kv_transfer_params": outs[0].kv_transfer_params,
        }

    def stream_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        choice: dict[str, Any] = {
            "index": index,
            "text": out.new_text,
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if c.logprobs is not None and out.new_token_ids:
            n = len(out.new_token_ids)
            if index not in self.offsets:
                self.offsets[index] = self.text_len(out.prior_output_token_ids + c.token_ids[:-n])
            lps = self.logprobs(out.new_token_ids, c.logprobs[-n:], self.offsets[index])
            self.offsets[index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
            choice["logprobs"] = lps
        if self.req.return_token_ids:
            choice["token_ids"] = out.new_token_ids
            if len(c.token_ids) == len(out.new_token_ids):
                choice["prompt_token_ids"] = out.prompt_token_ids
        return choice

    def logprobs(
        self, token_ids: list[int], lps: list[TokenLogprobs] | None, offset: int = 0
    ) -> dict[str, Any] | None:
        """OpenAI's parallel lists; `text_offset` counts token strings from the first output
        token (`offset`: the length of those before `token_ids`), streamed or not."""
        if lps is None:
            return None
        tok = self.token_str
        tokens = [tok(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top = [{tok(x.token_id): x.logprob for x in [*lp.top, lp.sampled]} for lp in lps]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.sampled.logprob for lp in lps],
            "top_logprobs": top,
            "text_offset": offsets,
        }


class ChatFormat(ResponseFormat):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"
    req: ChatCompletionRequest

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if self.req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {
            **self.header(self.object_name),
            "choices": choices,
            "usage": usage_of(outs, self.n),
            "kv_transfer_params": outs[0].kv_transfer_params,
        }
        if self.req.return_token_ids:
            body["prompt_token_ids"] = outs[0].prompt_token_ids
        return body

    def opening_chunks(self, header: dict[str, Any], out: RequestOutput) -> list[dict[str, Any]]:
        """The role chunks, one per choice: `delta: {role: assistant, content: ""}`, as OpenAI
        opens a stream."""
        chunks = []
        for i in range(self.n):
            delta = {"role": "assistant", "content": ""}
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            role = {**header, "choices": [choice]}
            if self.req.return_token_ids:
                role["prompt_token_ids"] = out.prompt_token_ids
            chunks.append(role)
        return chunks

    def stream_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": out.new_text},
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if c.logprobs is not None and out.new_token_ids:
            choice["logprobs"] = self.logprobs(
                out.new_token_ids, c.logprobs[-len(out.new_token_ids) :]
            )
        if self.req.return_token_ids:
            choice["token_ids"] = out.new_token_ids
        return choice

    def logprobs(
        self, token_ids: list[int], lps: list[TokenLogprobs] | None
    ) -> dict[str, Any] | None:
        if lps is None:
            return None
        content = []
        for token_id, lp in zip(token_ids, lps, strict=True):
            s = self.token_str(token_id)
            top = [
                {
                    "token": (t := self.token_str(x.token_id)),
                    "logprob": x.logprob,
                    "bytes": list(t.encode()),
                }
                for x in lp.top
            ]
            content.append(
                {
                    "token": s,
                    "logprob": lp.sampled.logprob,
                    "bytes": list(s.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content}
