"""One request through the fleet (DESIGN §2): prefill on P, t0 to the client, decode on D.

```
client ─▶ router ── body, max_tokens 1, do_remote_decode ─▶ P   (retry another P on failure)
                 ◀── t0, prompt_token_ids, kv_transfer_params ──
client ◀── t0 (first SSE chunk, at once)
                 ── prompt_token_ids + [t0], num_prior_output_tokens 1,
                    do_remote_prefill, streaming ─▶ D
client ◀── t1, t2, … (rewritten in the client's format)
```

No prefill instance answers → decode-only: the client's original body goes to D, which
prefills itself. t0 ends the request (EOS, stop, max_tokens 1) → the answer comes from P alone
and, once it is sent, the router tells P to free its held blocks (`POST /v1/kv/release`); were
that call lost, the lease frees them. (With max_tokens 1 P holds none: it is not asked to.)
The same release goes out when no decode instance accepts the request after t0 (the client
left, no healthy D, D failed or refused it): once D accepts, freeing P is D's job. If P's answer
itself never arrives (the client left while P computed, P timed out), the release names the
request id instead: P frees what it holds for it, now or when it finishes.
A batch of prompts, or `n` > 1, takes this path once per choice (router/batch.py). Colocated fleets skip
all of this: the body goes to one instance and its answer comes back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from splitserve.router import convert
from splitserve.router.batch import disaggregated_choices, fans_out
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import RoutingPolicy
from splitserve.router.registry import Instance, InstanceRegistry
from splitserve.router.upstream import (
    DONE,
    InstanceError,
    InstanceUnavailable,
    UpstreamClient,
    answer,
    error_response,
    is_event_stream,
    read_body,
    relay,
    sse,
    sse_error,
    sse_events,
)

logger = logging.getLogger(__name__)


class NoInstance(Exception):
    """No healthy instance of a role."""


class FleetProxy:
    def __init__(self, client: UpstreamClient, registry: InstanceRegistry,
                 policies: dict[str, RoutingPolicy], metrics: RouterMetrics,
                 prefill_retries: int = 1) -> None:
        self.client, self.registry, self.policies = client, registry, policies
        self.metrics, self.prefill_retries = metrics, prefill_retries
        self._releases: set[asyncio.Task] = set()  # fire-and-forget releases, kept referenced

    # ------------------------------------------------------------------ picking
    def pick(self, role: str, prompt: Any = None, exclude: set[str] | None = None) -> Instance:
        candidates = [i for i in self.registry.healthy(role) if i.url not in (exclude or ())]
        if not candidates:
            raise NoInstance(f"no healthy {role} instance")
        inst = self.policies[role].choose(candidates, prompt)
        self.policies[role].served(inst, prompt)
        return inst

    @property
    def colocated(self) -> bool:
        return bool(self.registry.healthy("colocated")) or not (
            any(i.role in ("prefill", "decode") for i in self.registry.all()))

    # ------------------------------------------------------------------ entry
    async def handle(self, path: str, raw: bytes, body: dict[str, Any] | None, chat: bool,
                     request_id: str, started: float, colocated: bool) -> Response:
        """`body` is the parsed request: valid, or None (invalid: it goes to an instance as is,
        for the error). Colocated (`self.colocated` when the request came), it is only parsed,
        not validated: the instance gets the raw bytes either way."""
        prompt = _prompt_key(body, chat)
        try:
            if colocated:
                return await self.forward("colocated", path, raw, request_id, prompt, started)
            if body is None:  # invalid: the instance answers the error
                return await self.forward("decode", path, raw, request_id, prompt, started)
            if fans_out(body, chat):
                return await disaggregated_choices(self, path, body, chat, request_id, prompt,
                                                   started)
            return await self.disaggregated(path, raw, body, chat, request_id, prompt, started)
        except NoInstance as err:
            self.metrics.errors.labels("no_instance").inc()
            return error_response(503, str(err), "no_healthy_instance", "service_unavailable",
                                  request_id=request_id)
        except InstanceError as err:
            self.metrics.errors.labels("instance_4xx").inc()
            return err.response(request_id)

    async def forward(self, role: str, path: str, raw: bytes, request_id: str, prompt: Any,
                      started: float) -> Response:
        """Send the body unchanged to an instance of `role` (another one if it is down).

        A stream is relayed chunk by chunk; any other answer is read whole first and goes back
        as one plain response (no streaming machinery for the common non-streamed request)."""
        tried: set[str] = set()
        while True:
            inst = self.pick(role, prompt, tried)
            tried.add(inst.url)
            inst.in_flight += 1
            try:
                upstream = await self.client.open_stream(inst, path, raw, request_id)
                if is_event_stream(upstream):
                    return relay(upstream, request_id, self._closer(inst, started))
                body = await read_body(upstream)
            except InstanceUnavailable as err:
                inst.in_flight -= 1
                self.registry.mark_down(inst, str(err))
                self.metrics.retries.inc()
                continue
            except BaseException:
                inst.in_flight -= 1
                raise
            inst.in_flight -= 1
            self.metrics.latency.observe(time.perf_counter() - started)
            return answer(upstream, body, request_id)

    def _closer(self, inst: Instance, started: float) -> Any:
        def on_close(failure: Exception | None) -> None:
            inst.in_flight -= 1
            self.metrics.latency.observe(time.perf_counter() - started)
            if failure is not None:
                self.metrics.errors.labels("stream_broken").inc()
                self.registry.mark_down(inst, f"stream broke: {failure}")
        return on_close

    # ------------------------------------------------------------------ P/D
    async def prefill(self, path: str, body: dict[str, Any], chat: bool, request_id: str,
                      prompt: Any) -> dict[str, Any] | None:
        """t0 from a prefill instance, trying up to 1 + prefill_retries of them; None: none."""
        p_body, tried = convert.prefill_body(body, chat), set()
        for attempt in range(1 + self.prefill_retries):
            try:
                inst = self.pick("prefill", prompt, tried)
            except NoInstance:
                break
            tried.add(inst.url)
            if attempt:
                self.metrics.retries.inc()
            inst.in_flight += 1
            try:
                result = await self.client.post_json(inst, path, p_body, request_id)
                return {**convert.prefill_result(result, chat), "prefill_url": inst.url}
            except InstanceUnavailable as err:
                logger.warning("%s: prefill on %s failed: %s", request_id, inst.url, err)
                self.registry.mark_down(inst, str(err))
                self._release_later(inst.url, {"request_id": request_id}, request_id)
            except asyncio.CancelledError:  # the client left: P may have finished all the same
                self._release_later(inst.url, {"request_id": request_id}, request_id)
                raise
            finally:
                inst.in_flight -= 1
        return None

    async def disaggregated(self, path: str, raw: bytes, body: dict[str, Any], chat: bool,
                            request_id: str, prompt: Any, started: float) -> Response:
        t0 = await self.prefill(path, body, chat, request_id, prompt)
        if t0 is None:
            logger.warning("%s: no prefill instance answered: decode-only", request_id)
            self.metrics.fallbacks.inc()
            return await self.forward("decode", path, raw, request_id, prompt, started)
        model = body.get("model") or self._model_name()
        stream = bool(body.get("stream"))
        self.metrics.ttft.observe(time.perf_counter() - started)
        if convert.stops_at_t0(body, chat, t0):
            release = self._release_prefill_blocks(t0, request_id)
            self.metrics.latency.observe(time.perf_counter() - started)
            if stream:
                return self._sse(self._t0_only(body, chat, request_id, model, t0), request_id,
                                 release)
            out = convert.full_response(body, chat, request_id, model, t0, None)
            return _json(out, request_id, release)
        d_body = convert.decode_body(body, chat, t0, stream)
        if stream:
            chunks = self._stream(body, chat, request_id, model, t0, d_body, started)
            return self._sse(chunks, request_id)
        try:
            rest = await self._decode(d_body, t0, request_id)
        except InstanceUnavailable as err:
            return error_response(502, f"decode instance failed: {err}", "decode_failed",
                                  "server_error", request_id=request_id)
        self.metrics.latency.observe(time.perf_counter() - started)
        return _json(convert.full_response(body, chat, request_id, model, t0, rest), request_id)

    async def _decode(self, d_body: dict[str, Any], t0: dict[str, Any], request_id: str
                      ) -> dict[str, Any]:
        """D's whole (non-streamed) answer; P's blocks freed if D never takes the request."""
        accepted = False
        d_inst = None
        try:
            d_inst = self.pick("decode", t0["prompt_token_ids"])
            d_inst.in_flight += 1
            rest = await self.client.post_json(d_inst, "/v1/completions", d_body, request_id)
            accepted = True
            return rest
        except InstanceUnavailable as err:
            self.registry.mark_down(d_inst, str(err))
            self.metrics.errors.labels("decode_failed").inc()
            raise
        finally:
            if d_inst is not None:
                d_inst.in_flight -= 1
            if not accepted:
                self._release_abandoned(t0, request_id)

    def _release_prefill_blocks(self, t0: dict[str, Any], request_id: str
                                ) -> BackgroundTask | None:
        """No decode instance will pull this request's KV: let P free it now, not at lease end.

        Run as the answer's background task, once the answer is sent: off the client's path."""
        if not t0.get("kv_transfer_params"):
            return None
        return BackgroundTask(self._release, t0["prefill_url"],
                              {"kv_transfer_params": t0["kv_transfer_params"]}, request_id)

    def _release_abandoned(self, t0: dict[str, Any], request_id: str) -> None:
        """The request ends before a decode instance accepted it (client gone, D failed or
        refused it): nobody will pull P's held KV, so free it now instead of at lease end.
        Should D have received the request after all, its own release or "done" comes too; P
        takes either once."""
        if t0.get("kv_transfer_params"):
            self._release_later(t0["prefill_url"],
                                {"kv_transfer_params": t0["kv_transfer_params"]}, request_id)

    def _release_later(self, url: str, payload: dict[str, Any], request_id: str) -> None:
        """`_release` as a task of its own: callers are closing streams or cancelled tasks.
        With `{"request_id"}` (P's answer never came: the client left, P timed out) P frees
        whatever that request holds, now or once it finishes."""
        task = asyncio.get_running_loop().create_task(self._release(url, payload, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, url: str, payload: dict[str, Any], request_id: str) -> None:
        try:
            await self.client.request("POST", f"{url}/v1/kv/release",
                                      msgspec.json.encode(payload), timeout_s=5.0)
        except InstanceUnavailable as err:  # the lease frees the blocks anyway
            logger.warning("%s: release on %s failed: %s", request_id, url, err)

    def _sse(self, chunks: AsyncIterator[bytes], request_id: str,
             background: BackgroundTask | None = None) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Request-Id": request_id}, background=background)

    async def _t0_only(self, body: dict[str, Any], chat: bool, request_id: str, model: str,
                       t0: dict[str, Any]) -> AsyncIterator[bytes]:
        out = convert.ClientChunks(body, chat, request_id, model)
        if chat:
            yield sse(out.role())
        yield sse(out.tokens(t0["text"], t0["token_ids"], t0["finish_reason"],
                             t0["stop_reason"], t0["logprobs"] if not chat else None))
        if out.include_usage:
            yield sse(out.usage(len(t0["prompt_token_ids"]), len(t0["token_ids"]),
                                t0["cached_tokens"]))
        yield DONE

    async def _stream(self, body: dict[str, Any], chat: bool, request_id: str, model: str,
                      t0: dict[str, Any], d_body: dict[str, Any],
                      started: float) -> AsyncIterator[bytes]:
        """t0 at once, then D's tokens; a D failure becomes an error event, never a hang. If the
        stream ends before D accepted the request (the client left, D failed or refused it),
        P's held blocks are released."""
        out = convert.ClientChunks(body, chat, request_id, model)
        n_prompt, n_out = len(t0["prompt_token_ids"]), len(t0["token_ids"])
        d_inst, response = None, None
        try:
            if chat:
                yield sse(out.role())
            yield sse(out.tokens(convert.t0_text_now(body, t0), t0["token_ids"], None, None,
                                 t0["logprobs"] if not chat else None))
            d_inst = self.pick("decode", t0["prompt_token_ids"])
            d_inst.in_flight += 1
            response = await self.client.open_stream(d_inst, "/v1/completions",
                                                     msgspec.json.encode(d_body), request_id)
            async for event in sse_events(response):
                if "error" in event:
                    yield sse(event)
                    break
                if event.get("usage") and not event.get("choices"):
                    n_out = event["usage"]["completion_tokens"]  # t0 included
                    continue
                c = event["choices"][0]
                yield sse(out.tokens(c.get("text", ""), c.get("token_ids") or [],
                                     c.get("finish_reason"), c.get("stop_reason"),
                                     c.get("logprobs")))
            if out.include_usage:
                yield sse(out.usage(n_prompt, n_out, t0["cached_tokens"]))
        except NoInstance as err:
            self.metrics.errors.labels("no_instance").inc()
            yield sse_error(str(err), "no_healthy_instance")
        except InstanceError as err:
            self.metrics.errors.labels("decode_4xx").inc()
            yield sse(msgspec.json.decode(err.body) if err.body else {"error": {}})
        except InstanceUnavailable as err:
            self.metrics.errors.labels("decode_failed").inc()
            if d_inst is not None:
                self.registry.mark_down(d_inst, str(err))
            yield sse_error(f"decode instance failed: {type(err).__name__}: {err}",
                            "decode_failed")
        finally:
            if response is not None:
                response.release()  # closes the connection instead if cut short
            else:  # D never answered 200: nobody will pull P's held KV
                self._release_abandoned(t0, request_id)
            if d_inst is not None:
                d_inst.in_flight -= 1
            self.metrics.latency.observe(time.perf_counter() - started)
        yield DONE

    def _model_name(self) -> str:
        for inst in self.registry.all():
            if inst.model:
                return inst.model
        return "unknown"


def _json(payload: dict[str, Any], request_id: str,
          background: BackgroundTask | None = None) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json",
                    headers={"X-Request-Id": request_id}, background=background)


def _prompt_key(body: dict[str, Any] | None, chat: bool) -> Any:
    """What prefix_aware hashes: the prompt text/ids, or the chat messages flattened."""
    if body is None:
        return None
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        return "".join(f"<{m.get('role')}>{m.get('content')}" for m in msgs
                       if isinstance(m, dict))
    return body.get("prompt")
