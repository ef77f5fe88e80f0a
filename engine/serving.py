"""OpenAI completions and chat completions over an AsyncLLM: request in, response or SSE out
(and vLLM's `/tokenize` and `/detokenize`, which share the prompt handling).

A request becomes one engine request per prompt (`{X-Request-Id}-{index}`), so the router can
name them. Every prompt's SamplingParams is checked before any is queued. Non-streamed answers
wait for every prompt; streamed ones send each update as a chunk as soon as the output loop hands
it over. The JSON of either is response_format.py's; the SSE plumbing is streaming.py's.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi.responses import JSONResponse, Response

from splitserve.engine.api_errors import APIError
from splitserve.engine.async_llm import AsyncLLM
from splitserve.engine.output_processor import RequestOutput
from splitserve.engine.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
)
from splitserve.engine.request import SamplingParams, check_prior_output, first_out_of_vocab
from splitserve.engine.request_stream import RequestStream
from splitserve.engine.response_format import ChatFormat, CompletionFormat, ResponseFormat
from splitserve.engine.streaming import SSEBody, SSEResponse, collect


class OpenAIServing:
    """The two generation endpoints of one instance, over its AsyncLLM."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer

    async def completions(self, req: CompletionRequest, base_id: str) -> Response:
        prompts = [
            (p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, p) for p in req.prompts
        ]
        streams = self._add(req, base_id, prompts, req.max_tokens, req.num_prior_output_tokens)
        fmt = CompletionFormat(req, f"cmpl-{base_id}", self.model_name, self.tokenizer)
        return await self._respond(req, streams, fmt)

    async def chat_completions(self, req: ChatCompletionRequest, base_id: str) -> Response:
        text, ids = self._chat_prompt(req.messages, req.add_generation_prompt)
        streams = self._add(req, base_id, [(text, ids)], req.max_output_tokens)
        fmt = ChatFormat(req, f"chatcmpl-{base_id}", self.model_name, self.tokenizer)
        return await self._respond(req, streams, fmt)

    async def tokenize(self, req: TokenizeRequest, base_id: str) -> Response:
        """vLLM's `/tokenize`: the ids a completion or chat request would generate from."""
        if req.messages is not None:
            ids = self._chat_prompt(req.messages, req.add_generation_prompt)[1]
        else:
            ids = self.tokenizer.encode(req.prompt or "", req.add_special_tokens)
        out = TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)
        return JSONResponse(out.model_dump())

    async def detokenize(self, req: DetokenizeRequest, base_id: str) -> Response:
        vocab = self.engine.vocab_size
        bad = first_out_of_vocab(req.tokens, vocab)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of range [0, {vocab})",
                           param="tokens", code="invalid_value")
        text = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    def release_unanswered(self, base_id: str) -> bool:
        """The caller of request `base_id` (its X-Request-Id) gave up on the answer: what its
        prompts hold for a consumer, now or once they finish, is freed. True when some already
        held blocks."""
        held_kv, held, i = self.engine.held_kv, False, 0
        while True:  # prompt 0 always (it may not have finished yet), then every one known
            rid = f"{base_id}-{i}"
            if i and rid not in self.engine.streams and not held_kv.knows(rid):
                return held
            held |= held_kv.unwanted(rid)
            i += 1

    # ------------------------------------------------------------------------------ shared
    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool
                     ) -> tuple[str, list[int]]:
        """The chat template's text and its ids (no special tokens added: the template has
        them); a template error is the messages' fault (400)."""
        turns = [{"role": m.role, "content": m.text} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt)
        except ValueError as err:
            raise APIError(400, f"messages: {err}", param="messages",
                           code="invalid_value") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def _add(
        self,
        req: SamplingFields,
        base_id: str,
        prompts: list[tuple[str | None, list[int]]],
        max_tokens: int | None,
        num_prior: int = 0,
    ) -> list[RequestStream]:
        """Build every prompt's SamplingParams first (a bad one queues nothing), then queue
        `n` requests per prompt: choice j of prompt i is request `{base_id}-{i * n + j}`, its
        choice `index` in the answer.

        The last `num_prior` tokens of each prompt are prior output: limits are those of the
        prompt before them, as in the colocated run that generated them."""
        params = [
            self._sampling_params(req, len(ids) - num_prior, max_tokens) for _, ids in prompts
        ]
        for (_, ids), sp in zip(prompts, params, strict=True):
            if not ids:
                raise APIError(400, "prompt is empty (no tokens after tokenization)",
                               param="prompt", code="invalid_value")
            problem = sp.choices_error(num_prior, req.kv_transfer_params)
            if problem is not None:
                raise APIError(400, problem[1], param=problem[0], code="invalid_value")
            try:
                check_prior_output(num_prior, len(ids), sp.max_tokens)
            except ValueError as err:
                raise APIError(
                    400, str(err), param="num_prior_output_tokens", code="invalid_value"
                ) from None
        streams: list[RequestStream] = []
        n = req.n
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params, strict=True)):
                for j in range(n):
                    streams.append(
                        self.engine.add_request(
                            f"{base_id}-{i * n + j}",
                            text,
                            ids,
                            sp.for_choice(j),
                            req.priority,
                            req.kv_transfer_params,
                            num_prior,
                        )
                    )
        except ValueError as err:
            self._abandon(streams)
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
            params = SamplingParams(
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
                logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids,
                n=req.n,
            )
        except ValueError as err:
            raise APIError(400, str(err), code="invalid_value") from None
        problem = params.vocab_error(self.engine.vocab_size)
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0], code="invalid_value")
        return params

    def _abandon(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.engine.abandon(s)

    async def _respond(
        self, req: SamplingFields, streams: list[RequestStream], fmt: ResponseFormat
    ) -> Response:
        """The answer, once the first update of every prompt (streamed) or the last (not) is in.
        Unless the answer is returned or a streamed body took the requests over, they are
        abandoned (aborted, or their held KV freed: cancelled when the client left)."""
        handed_over = False
        try:
            if req.stream:
                # The first update (or the core's refusal) decides the status line.
                firsts = [await s.get() for s in streams]
                _raise_if_failed([o for o in firsts if o.finished])
                body = SSEBody(
                    streams,
                    firsts,
                    fmt.stream_events,
                    fmt.stream_end,
                    lambda: self._abandon(streams),
                )
                handed_over = True
                return SSEResponse(body)
            outs = await asyncio.gather(*(collect(s) for s in streams))
            _raise_if_failed(outs)
            response = Response(msgspec.json.encode(fmt.body(outs)), media_type="application/json")
            handed_over = True
            return response
        finally:
            if not handed_over:
                self._abandon(streams)


def _raise_if_failed(outs: list[RequestOutput]) -> None:
    for out in outs:
        if out.error is not None or out.outputs[0].finish_reason == "error":
            raise APIError(
                500, f"request failed: {out.error}", type_="server_error", code="request_failed"
            )
