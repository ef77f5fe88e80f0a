"""OpenAI completions and chat completions over an AsyncLLM: request in, response or SSE out.

A request becomes one engine request per prompt (`{X-Request-Id}-{index}`), so the router can
name them. Non-streamed answers wait for every prompt; streamed ones send each update as a chunk
as soon as the output loop hands it over. Chunks are plain dicts encoded by msgspec (shaped as
`protocol.CompletionStreamResponse` / `ChatCompletionStreamResponse`): pydantic per token would
cost more than the rest of the front end together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi.responses import Response

from splitserve.engine.async_llm import AsyncLLM, RequestStream
from splitserve.engine.output_processor import RequestOutput
from splitserve.engine.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from splitserve.engine.request import SamplingParams, TokenLogprobs, check_prior_output
from splitserve.engine.streaming import (
    SSEBody,
    SSEResponse,
    collect,
    iterate_streams,
    sse,
    with_errors,
)


class APIError(Exception):
    """An OpenAI error answer: the server turns it into `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _usage_of(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Prior output (`num_prior_output_tokens`) counts as completion, not prompt: the usage of
    a decode instance's answer is that of the whole request, as a colocated run reports it."""
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(o.num_output_tokens for o in outputs),
        sum(o.num_cached_tokens for o in outputs),
    )


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer

    # ------------------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, base_id: str) -> Response:
        prompts = [
            (p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, p) for p in req.prompts
        ]
        streams = self._add(req, base_id, prompts, req.max_tokens, req.num_prior_output_tokens)
        return await self._respond(
            req, streams, f"cmpl-{base_id}", self._completion_body, self._completion_chunks
        )

    def _completion_body(
        self, req: CompletionRequest, rid: str, outs: list[RequestOutput]
    ) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choice = {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": self._completion_logprobs(
                    c.token_ids, c.logprobs, self._text_len(out.prior_output_token_ids)
                ),
            }
            if req.return_token_ids:
                choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage_of(outs),
            "kv_transfer_params": outs[0].kv_transfer_params,
        }

    async def _completion_chunks(
        self,
        req: CompletionRequest,
        rid: str,
        updates: AsyncIterator[tuple[int, RequestOutput]],
        num_prompts: int,
    ) -> AsyncIterator[bytes]:
        created, finals = int(time.time()), {}
        offsets: dict[int, int] = {}  # per prompt: text_offset of its next token
        base = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        async for i, out in updates:
            c = out.outputs[0]
            choice: dict[str, Any] = {
                "index": i,
                "text": out.new_text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.logprobs is not None and out.new_token_ids:
                n = len(out.new_token_ids)
                if i not in offsets:
                    offsets[i] = self._text_len(out.prior_output_token_ids + c.token_ids[:-n])
                lps = self._completion_logprobs(out.new_token_ids, c.logprobs[-n:], offsets[i])
                offsets[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                choice["logprobs"] = lps
            if req.return_token_ids:
                choice["token_ids"] = out.new_token_ids
                if len(c.token_ids) == len(out.new_token_ids):
                    choice["prompt_token_ids"] = out.prompt_token_ids
            chunk = {**base, "choices": [choice]}
            if req.continuous_usage:
                chunk["usage"] = _usage_of([out])
            if out.finished:
                finals[i] = out
                if out.kv_transfer_params is not None:
                    chunk["kv_transfer_params"] = out.kv_transfer_params
            yield sse(chunk)
        if req.include_usage and len(finals) == num_prompts:
            yield sse({**base, "choices": [], "usage": _usage_of(list(finals.values()))})

    def _completion_logprobs(
        self, token_ids: list[int], lps: list[TokenLogprobs] | None, offset: int = 0
    ) -> dict[str, Any] | None:
        """OpenAI's parallel lists; `text_offset` counts token strings from the first output
        token (`offset`: the length of those before `token_ids`), streamed or not."""
        if lps is None:
            return None
        tok = self._token_str
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

    # ------------------------------------------------------------------------------ chat
    async def chat_completions(self, req: ChatCompletionRequest, base_id: str) -> Response:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        text = self.tokenizer.apply_chat_template(messages, req.add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        streams = self._add(req, base_id, [(text, ids)], req.max_output_tokens)
        return await self._respond(
            req, streams, f"chatcmpl-{base_id}", self._chat_body, self._chat_chunks
        )

    def _chat_body(
        self, req: ChatCompletionRequest, rid: str, outs: list[RequestOutput]
    ) -> dict[str, Any]:
        out = outs[0]
        c = out.outputs[0]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage_of(outs),
            "kv_transfer_params": out.kv_transfer_params,
        }
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
            body["prompt_token_ids"] = out.prompt_token_ids
        return body

    async def _chat_chunks(
        self,
        req: ChatCompletionRequest,
        rid: str,
        updates: AsyncIterator[tuple[int, RequestOutput]],
        num_prompts: int,
    ) -> AsyncIterator[bytes]:
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        first, final = True, None
        async for _, out in updates:
            c = out.outputs[0]
            if first:
                role = {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                if req.return_token_ids:
                    role["prompt_token_ids"] = out.prompt_token_ids
                yield sse(role)
                first = False
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": out.new_text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.logprobs is not None and out.new_token_ids:
                choice["logprobs"] = self._chat_logprobs(
                    out.new_token_ids, c.logprobs[-len(out.new_token_ids) :]
                )
            if req.return_token_ids:
                choice["token_ids"] = out.new_token_ids
            chunk = {**base, "choices": [choice]}
            if req.continuous_usage:
                chunk["usage"] = _usage_of([out])
            if out.finished:
                final = out
                if out.kv_transfer_params is not None:
                    chunk["kv_transfer_params"] = out.kv_transfer_params
            yield sse(chunk)
        if req.include_usage and final is not None:
            yield sse({**base, "choices": [], "usage": _usage_of([final])})

    def _chat_logprobs(
        self, token_ids: list[int], lps: list[TokenLogprobs] | None
    ) -> dict[str, Any] | None:
        if lps is None:
            return None
        content = []
        for token_id, lp in zip(token_ids, lps, strict=True):
            s = self._token_str(token_id)
            top = [
                {
                    "token": (t := self._token_str(x.token_id)),
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

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _text_len(self, token_ids: list[int]) -> int:
        return sum(len(self._token_str(t)) for t in token_ids)

    # ------------------------------------------------------------------------------ shared
    def _add(
        self,
        req: SamplingFields,
        base_id: str,
        prompts: list[tuple[str | None, list[int]]],
        max_tokens: int | None,
        num_prior: int = 0,
    ) -> list[RequestStream]:
        """Build every prompt's SamplingParams first (a bad one queues nothing), then queue.

        The last `num_prior` tokens of each prompt are prior output: limits are those of the
        prompt before them, as in the colocated run that generated them."""
        params = [
            self._sampling_params(req, len(ids) - num_prior, max_tokens) for _, ids in prompts
        ]
        for (_, ids), sp in zip(prompts, params, strict=True):
            try:
                check_prior_output(num_prior, len(ids), sp.max_tokens)
            except ValueError as err:
                raise APIError(
                    400, str(err), param="num_prior_output_tokens", code="invalid_value"
                ) from None
        streams: list[RequestStream] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params, strict=True)):
                streams.append(
                    self.engine.add_request(
                        f"{base_id}-{i}",
                        text,
                        ids,
                        sp,
                        req.priority,
                        req.kv_transfer_params,
                        num_prior,
                    )
                )
        except ValueError as err:
            self._abort(streams)
            raise APIError(400, str(err), param="X-Request-Id", code="duplicate_id") from None
        return streams

    def _sampling_params(
        self, req: SamplingFields, prompt_len: int, max_tokens: int | None
    ) -> SamplingParams:
        max_len = self.engine.max_model_len
        if max_tokens is None:
            max_tokens = max(1, max_len - prompt_len)
        elif prompt_len < max_len and prompt_len + max_tokens > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens, but "
                f"{prompt_len + max_tokens} were requested ({prompt_len} in the "
                f"prompt, {max_tokens} in the completion); lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                stop=req.stop_list,
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=req.num_logprobs,  # type: ignore[attr-defined]
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as err:
            raise APIError(400, str(err), code="invalid_value") from None

    def _abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.engine.abort(s.request_id)

    async def _respond(
        self, req: Any, streams: list[RequestStream], rid: str, body: Callable, chunks: Callable
    ) -> Response:
        handed_over = False
        try:
            if req.stream:
                # The first update (or the core's refusal) decides the status line.
                firsts = [await s.get() for s in streams]
                _raise_if_failed([o for o in firsts if o.finished])
                events = with_errors(
                    chunks(req, rid, iterate_streams(streams, firsts), len(streams))
                )
                handed_over = True
                return SSEResponse(SSEBody(events, lambda: self._abort(streams)))
            outs = await asyncio.gather(*(collect(s) for s in streams))
            _raise_if_failed(outs)
            return Response(
                msgspec.json.encode(body(req, rid, outs)), media_type="application/json"
            )
        finally:
            if not handed_over:
                self._abort(streams)


def _raise_if_failed(outs: list[RequestOutput]) -> None:
    for out in outs:
        if out.error is not None or out.outputs[0].finish_reason == "error":
            raise APIError(
                500, f"request failed: {out.error}", type_="server_error", code="request_failed"
            )
