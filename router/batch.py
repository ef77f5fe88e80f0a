"""Several choices through P/D (a completion `prompt` list, `n` > 1): one flow per choice.

Each choice takes the single-prompt path (`FleetProxy.disaggregated`: its own prefill, t0 at
once, its own decode with t0 as prior output), so every choice gets what a colocated instance
gives it, and the prefills run in parallel on the prefill fleet instead of on one decode
instance. Choice j of prompt i is a request with `n: 1` and, when seeded, `seed + j`, as an
instance samples it. The answers merge back into the shape an instance gives: choice `index`
is i * n + j; usage sums completions and counts each prompt once; streamed, the choices' chunks
interleave as they come and one usage chunk (if asked for) ends the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from splitserve.engine.protocol import split_prompts
from splitserve.router import convert
from splitserve.router.upstream import DONE, sse

if TYPE_CHECKING:
    from splitserve.router.pd import FleetProxy


def fans_out(body: dict[str, Any] | None, chat: bool) -> bool:
    """More than one choice: `n` > 1, or several prompts in a completion request."""
    if body is None:
        return False
    return (body.get("n") or 1) > 1 or (not chat and len(split_prompts(body.get("prompt"))) > 1)


def _choice_bodies(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """One single-choice body per choice, in choice order."""
    n, seed = body.get("n") or 1, body.get("seed")
    subs = []
    for prompt in [None] if chat else split_prompts(body.get("prompt")):
        for j in range(n):
            sub = {**body, "n": 1}
            if not chat:
                sub["prompt"] = prompt
            if seed is not None:
                sub["seed"] = seed + j
            subs.append(sub)
    if body.get("stream"):  # every sub-stream ends with its usage, which is summed here
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        subs = [{**s, "stream_options": options} for s in subs]
    return subs


async def disaggregated_choices(
    proxy: FleetProxy, path: str, body: dict[str, Any], chat: bool, request_id: str,
    prompt: Any, started: float
) -> Response:
    """Every choice through P/D at once; one answer. A failed choice fails the request."""
    stream, n = bool(body.get("stream")), body.get("n") or 1
    subs = _choice_bodies(body, chat)
    results = await asyncio.gather(
        *(
            proxy.disaggregated(path, msgspec.json.encode(s), s, chat, f"{request_id}-{k}",
                                prompt if chat else s["prompt"], started)
            for k, s in enumerate(subs)
        ),
        return_exceptions=True,
    )
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    failed = failure or next((r for r in results if r.status_code != 200), None)
    if failed is not None:
        await _discard([r for r in results if isinstance(r, Response) and r is not failed])
        if failure is not None:
            raise failure
        return failed
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
    if not stream:
        answers = [msgspec.json.decode(r.body) for r in results]
        return Response(
            msgspec.json.encode(_merge(answers, rid, n)),
            media_type="application/json",
            headers={"X-Request-Id": request_id},
            background=_after(results),
        )
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(
        _interleave(results, rid, n, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
    )


def _merge(answers: list[dict[str, Any]], rid: str, n: int) -> dict[str, Any]:
    """The first answer's shape (object, model, chat's prompt_token_ids), every choice."""
    choices = [{**a["choices"][0], "index": k} for k, a in enumerate(answers)]
    usage = _sum_usage([a["usage"] for a in answers], n)
    return {**answers[0], "id": rid, "created": int(time.time()), "choices": choices,
            "usage": usage}


def _sum_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Completions summed; a prompt's tokens (and cache hits) once, from its first choice."""
    firsts = usages[::n]
    return convert.usage(
        sum(u["prompt_tokens"] for u in firsts),
        sum(u["completion_tokens"] for u in usages),
        sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in firsts),
    )


def _after(responses: list[Response]) -> BackgroundTask | None:
    """The sub-answers' background work (releasing a prefill's blocks) as one task."""
    tasks = [r.background for r in responses if r.background is not None]
    if not tasks:
        return None

    async def run() -> None:
        for task in tasks:
            await task()

    return BackgroundTask(run)


async def _discard(responses: list[Response]) -> None:
    """Drop sub-answers the client will not get: close their streams, run their releases."""
    for r in responses:
        if isinstance(r, StreamingResponse) and hasattr(r.body_iterator, "aclose"):
            await r.body_iterator.aclose()
        if r.background is not None:
            await r.background()


async def _interleave(
    responses: list[StreamingResponse], rid: str, n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """The sub-streams' chunks as they come, re-indexed; an error event ends the stream.

    However it ends (done, error, client gone), every sub-stream is closed, which aborts its
    decode request."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()

    async def pump(i: int, response: StreamingResponse) -> None:
        try:
            async for event in _events(response.body_iterator):
                queue.put_nowait((i, event))
            if response.background is not None:
                await response.background()
        finally:
            queue.put_nowait((i, None))
            await response.body_iterator.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(responses)]
    usages: dict[int, dict[str, Any]] = {}  # choice index → its usage
    open_streams, base = len(tasks), None
    try:
        while open_streams:
            i, event = await queue.get()
            if event is None:
                open_streams -= 1
            elif "error" in event:
                yield sse(event)
                break
            elif event.get("usage") and not event.get("choices"):
                usages[i] = event["usage"]
                base = base or event
            else:
                base = base or event
                for choice in event.get("choices") or []:
                    choice["index"] = i
                yield sse({**event, "id": rid})
        else:
            if include_usage and usages and base is not None:
                usage = _sum_usage([usages[k] for k in sorted(usages)], n)
                yield sse({**base, "id": rid, "choices": [], "usage": usage})
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    yield DONE


async def _events(chunks: AsyncIterator[bytes | str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE body; read to its end (past `[DONE]`), so the body's own
    clean-up runs now."""
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + (chunk.encode() if isinstance(chunk, str) else chunk)).split(
            b"\n"
        )
        for line in lines:
            data = line[6:].rstrip(b"\r") if line.startswith(b"data: ") else b"[DONE]"
            if data != b"[DONE]":
                yield msgspec.json.decode(data)
