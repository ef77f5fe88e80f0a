"""A batch of prompts (a completion `prompt` list of several) through P/D: one flow per prompt.

Each prompt takes the single-prompt path (`FleetProxy.disaggregated`: its own prefill, t0 at
once, its own decode with t0 as prior output), so every prompt of a batch gets what a colocated
instance gives it, and the batch's prompts prefill in parallel on the prefill fleet instead of
on one decode instance. The answers merge back into the shape an instance gives a batch:
choice `index` is the prompt's place and usage is summed; streamed, the prompts' chunks
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

from splitserve.router import convert
from splitserve.router.upstream import DONE, sse

if TYPE_CHECKING:
    from splitserve.router.pd import FleetProxy


def is_batch(body: dict[str, Any] | None, chat: bool) -> bool:
    """Several prompts in one completion request (text or token-id lists)."""
    if body is None or chat or not isinstance(body.get("prompt"), list):
        return False
    prompt = body["prompt"]
    return len(prompt) > 1 and not isinstance(prompt[0], int)


async def disaggregated_batch(
    proxy: FleetProxy, path: str, body: dict[str, Any], request_id: str, started: float
) -> Response:
    """Every prompt through P/D at once; one answer. A failed prompt fails the request."""
    stream = bool(body.get("stream"))
    subs = [{**body, "prompt": p} for p in body["prompt"]]
    if stream:  # every sub-stream ends with its usage, which is summed here
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        subs = [{**s, "stream_options": options} for s in subs]
    results = await asyncio.gather(
        *(
            proxy.disaggregated(
                path, msgspec.json.encode(s), s, False, f"{request_id}-{i}", s["prompt"], started
            )
            for i, s in enumerate(subs)
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
    if not stream:
        answers = [msgspec.json.decode(r.body) for r in results]
        return Response(
            msgspec.json.encode(_merge(answers, request_id)),
            media_type="application/json",
            headers={"X-Request-Id": request_id},
            background=_after(results),
        )
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(
        _interleave(results, request_id, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
    )


def _merge(answers: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    choices = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = _sum_usage([a["usage"] for a in answers])
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": answers[0].get("model"),
        "choices": choices,
        "usage": usage,
    }


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    return convert.usage(
        sum(u["prompt_tokens"] for u in usages),
        sum(u["completion_tokens"] for u in usages),
        sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages),
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
    responses: list[StreamingResponse], request_id: str, include_usage: bool
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
    usages, open_streams, base = [], len(tasks), None
    try:
        while open_streams:
            i, event = await queue.get()
            if event is None:
                open_streams -= 1
            elif "error" in event:
                yield sse(event)
                break
            elif event.get("usage") and not event.get("choices"):
                usages.append(event["usage"])
                base = base or event
            else:
                base = base or event
                for choice in event.get("choices") or []:
                    choice["index"] = i
                yield sse({**event, "id": f"cmpl-{request_id}"})
        else:
            if include_usage and usages and base is not None:
                yield sse(
                    {**base, "id": f"cmpl-{request_id}", "choices": [], "usage": _sum_usage(usages)}
                )
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
