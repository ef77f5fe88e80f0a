"""Message shaping for the P/D flow: the prefill body, the decode body, and the client's answer.

The prefill instance gets the client's body as is (same tokenization, same chat template) with
`max_tokens: 1`, no streaming, `return_token_ids` and `kv_transfer_params: {do_remote_decode}`
(not when the client asked for one token: then t0 is the whole answer).
The decode instance always gets a *completion* with a token-id prompt, `prompt_token_ids + [t0]`,
so it never re-tokenizes and its positions match a colocated run, and `num_prior_output_tokens: 1`,
so it counts t0 as output, not prompt: penalties, `min_tokens`/`max_tokens` (the client's, as
they are), stop strings spanning t0 and t1, and usage are those of a colocated run. Its completion
chunks are then rewritten in the client's format (completion or chat).

t0's text goes to the client at once, except an ending that may begin a stop string
(`deliverable_text_len`): the decode instance, primed with t0, sends that part once it knows.
"""

from __future__ import annotations

import time
from typing import Any

from splitserve.engine.protocol import deliverable_text_len

# Sampling fields a decode request inherits from the client's request.
_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "include_stop_str_in_output", "skip_special_tokens", "priority",
             "logit_bias", "allowed_token_ids")


def max_output_tokens(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        return body.get("max_completion_tokens") or body.get("max_tokens")
    return body.get("max_tokens", 16)


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    p = {k: v for k, v in body.items() if k not in ("stream", "stream_options",
                                                    "max_completion_tokens",
                                                    "kv_transfer_params")}
    p.update(max_tokens=1, stream=False, return_token_ids=True)
    if max_output_tokens(body, chat) != 1:
        # A one-token request ends at t0: no decode instance follows, so P need not hold (or
        # send, or save) its KV, and the router need not release it afterwards.
        p["kv_transfer_params"] = {"do_remote_decode": True}
    if p.get("min_tokens"):
        p["min_tokens"] = min(int(p["min_tokens"]), 1)
    return p


def prefill_result(answer: dict[str, Any], chat: bool) -> dict[str, Any]:
    """t0 and what D needs from the prefill instance's answer."""
    choice = answer["choices"][0]
    prompt_ids = answer.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
    text = choice["message"]["content"] if chat else choice["text"]
    return {"prompt_token_ids": prompt_ids or [], "token_ids": choice.get("token_ids") or [],
            "text": text or "", "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason"), "logprobs": choice.get("logprobs"),
            "kv_transfer_params": answer.get("kv_transfer_params"),
            "cached_tokens": ((answer.get("usage") or {}).get("prompt_tokens_details")
                              or {}).get("cached_tokens", 0)}


def decode_body(body: dict[str, Any], chat: bool, t0: dict[str, Any],
                stream: bool) -> dict[str, Any]:
    d = {k: body[k] for k in _SAMPLING if k in body}
    d.update(prompt=t0["prompt_token_ids"] + t0["token_ids"],
             num_prior_output_tokens=len(t0["token_ids"]), stream=stream,
             max_tokens=max_output_tokens(body, chat),
             return_token_ids=bool(body.get("return_token_ids")))
    if stream:
        d["stream_options"] = {"include_usage": True}
    if chat and body.get("logprobs"):
        d["logprobs"] = body.get("top_logprobs") or 0
    elif not chat and body.get("logprobs") is not None:
        d["logprobs"] = body["logprobs"]
    if t0["kv_transfer_params"]:
        d["kv_transfer_params"] = t0["kv_transfer_params"]
    return d


def t0_text_now(body: dict[str, Any], t0: dict[str, Any]) -> str:
    """What of t0's text the client gets before the decode instance answers (module doc)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    n = deliverable_text_len(t0["text"], stops, bool(body.get("include_stop_str_in_output")))
    return t0["text"][:n]


def stops_at_t0(body: dict[str, Any], chat: bool, t0: dict[str, Any]) -> bool:
    """EOS / stop string / stop token on t0, or the client asked for one token only."""
    return t0["finish_reason"] == "stop" or max_output_tokens(body, chat) == 1


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(lp: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completion-style logprobs (parallel lists) → chat-style (one entry per token)."""
    if not lp:
        return None
    content = []
    for tok, val, top in zip(lp.get("tokens", []), lp.get("token_logprobs", []),
                             lp.get("top_logprobs") or [None] * len(lp.get("tokens", [])),
                             strict=False):
        tops = [{"token": t, "logprob": v, "bytes": list(t.encode())}
                for t, v in (top or {}).items() if t != tok]
        content.append({"token": tok, "logprob": val, "bytes": list(tok.encode()),
                        "top_logprobs": tops})
    return {"content": content}


class ClientChunks:
    """Builds the client's SSE payloads (completion or chat chunks) for one request."""

    def __init__(self, body: dict[str, Any], chat: bool, request_id: str, model: str) -> None:
        self.chat, self.body = chat, body
        self.base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        self.return_token_ids = bool(body.get("return_token_ids"))

    def role(self) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                          "logprobs": None, "finish_reason": None}]}

    def tokens(self, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: Any = None, logprobs: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text},
                      "logprobs": chat_logprobs(logprobs)}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs}
        choice.update(finish_reason=finish_reason, stop_reason=stop_reason)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return {**self.base, "choices": [choice]}

    def usage(self, prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage(prompt, completion, cached)}


def full_response(body: dict[str, Any], chat: bool, request_id: str, model: str,
                  t0: dict[str, Any], rest: dict[str, Any] | None) -> dict[str, Any]:
    """A non-streamed answer: t0 from the prefill, the rest (if any) from the decode, whose
    usage counts t0 among the completion tokens."""
    text, ids = t0["text"], list(t0["token_ids"])
    finish, stop_reason = t0["finish_reason"], t0["stop_reason"]
    logprobs = t0["logprobs"]
    n_out = len(ids)
    if rest is not None:
        c = rest["choices"][0]
        text = t0_text_now(body, t0) + c.get("text", "")
        ids += c.get("token_ids") or []
        finish, stop_reason = c.get("finish_reason"), c.get("stop_reason")
        logprobs = merge_logprobs(logprobs, c.get("logprobs"))
        n_out = rest["usage"]["completion_tokens"]
    u = usage(len(t0["prompt_token_ids"]), n_out, t0["cached_tokens"])
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": chat_logprobs(logprobs) if rest else logprobs,
                                  "finish_reason": finish, "stop_reason": stop_reason}
        out = {"id": f"chatcmpl-{request_id}", "object": "chat.completion",
               "created": int(time.time()), "model": model, "choices": [choice], "usage": u}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason}
        out = {"id": f"cmpl-{request_id}", "object": "text_completion",
               "created": int(time.time()), "model": model, "choices": [choice], "usage": u}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
        (out if chat else choice)["prompt_token_ids"] = t0["prompt_token_ids"]
    return out


def merge_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Concatenate completion-style logprobs (t0's from P, the rest from D)."""
    if a is None or b is None:
        return a or b
    if "content" in a:  # chat-style t0 from P: bring it to completion style first
        a = {"tokens": [c["token"] for c in a["content"]],
             "token_logprobs": [c["logprob"] for c in a["content"]],
             "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]}
                              for c in a["content"]], "text_offset": []}
    return {k: list(a.get(k) or []) + list(b.get(k) or [])
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
