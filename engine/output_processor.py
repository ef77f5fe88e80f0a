"""Front-end side of the engine: detokenize, apply stop strings, build RequestOutputs.

The engine core works in tokens only; text lives here, in the process that talks to clients (the
offline LLM, or the HTTP server). A stop string is found here, so the core is told to abort that
request.

A request with prior output (`num_prior_output_tokens`: a decode instance continuing a prefill
instance's t0) starts in the state a colocated run reaches after those tokens: its detokenizer is
primed with them, so a stop string that spans them and the new tokens is found, and its text is
released from where a colocated stream would stand (`deliverable_text_len`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.protocol import deliverable_text_len
from splitserve.engine.request import EngineCoreOutput, SamplingParams, TokenLogprobs
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    """What this request generated: without prior output, whose text the client already has."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.sampled.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_text: str = ""  # text completed by this update (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    prior_output_token_ids: list[int] = field(default_factory=list)  # generated elsewhere

    @property
    def num_output_tokens(self) -> int:
        """Every output token, prior ones included: what usage counts as completion."""
        return len(self.prior_output_token_ids) + len(self.outputs[0].token_ids)


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer | None,
                 num_prior_output_tokens: int = 0) -> None:
        self.request_id = request_id
        self.prompt = prompt
        n = len(prompt_token_ids) - num_prior_output_tokens
        self.prompt_token_ids = prompt_token_ids[:n] if num_prior_output_tokens else prompt_token_ids
        self.prior_output_token_ids = prompt_token_ids[n:] if num_prior_output_tokens else []
        self.params = params
        self.detok = (IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.text = ""  # of every output token, prior ones included
        self.emitted = 0  # characters of text already handed out (or delivered before)
        if self.detok is not None and self.prior_output_token_ids:
            self.detok.push(self.prior_output_token_ids)
            self.text = self.detok.text
            self.emitted = deliverable_text_len(self.text, params.stop,
                                                params.include_stop_str_in_output)
        self.text_start = self.emitted  # this request's answer text begins here
        self.arrival_time = time.time()
        self.first_token_time: float | None = None

    def update(self, out: EngineCoreOutput) -> tuple[RequestOutput, bool]:
        """Fold one core output in; returns the RequestOutput and whether a stop string hit."""
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.time()
        finish, stop_reason, stop_hit = out.finish_reason, out.stop_reason, False
        if self.detok is not None:
            self.detok.push(out.new_token_ids)
            self.text = self.detok.text
            hit = self._find_stop()
            if hit is not None and out.finish_reason != "error":
                finish, stop_reason, stop_hit = "stop", hit, True
        finished = finish is not None
        # Hold back a possible stop-string prefix until we know it is not one.
        end = len(self.text)
        if not finished:
            end = max(self.emitted, deliverable_text_len(self.text, self.params.stop,
                                                         self.params.include_stop_str_in_output))
        new_text, self.emitted = self.text[self.emitted : end], max(self.emitted, end)
        completion = CompletionOutput(0, self.text[self.text_start :], list(self.token_ids),
                                      self.logprobs, finish, stop_reason)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [completion], finished,
            new_text=new_text, new_token_ids=list(out.new_token_ids),
            num_cached_tokens=out.num_cached_tokens, kv_transfer_params=out.kv_transfer_params,
            error=out.error, arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            prior_output_token_ids=self.prior_output_token_ids), stop_hit

    def _find_stop(self) -> str | None:
        if not self.params.stop:
            return None
        search_from = max(0, self.emitted - self.max_stop_len)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop) if self.params.include_stop_str_in_output else idx]
        return stop


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, num_prior_output_tokens: int = 0) -> None:
        """`prompt_token_ids` as the core gets them: the last `num_prior_output_tokens` are
        prior output (see EngineCoreRequest)."""
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                               self.tokenizer, num_prior_output_tokens)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """→ (outputs for clients, request ids the core must abort because a stop string hit)."""
        results, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted by the client meanwhile
            result, stop_hit = state.update(out)
            results.append(result)
            if result.finished:
                del self.states[out.request_id]
                if stop_hit and out.finish_reason is None:
                    to_abort.append(out.request_id)
        return results, to_abort
