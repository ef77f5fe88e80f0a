"""Streaming plumbing of the OpenAI server: SSE bodies that always abort, and stream merging.

However a streamed response ends (last chunk, client disconnect, a failed write to a closed
socket, or a response that is never sent), its engine requests are aborted exactly once, so
their KV blocks are freed. A request that fails after the headers went out becomes an SSE error
event followed by `[DONE]`, as OpenAI-compatible clients expect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

from splitserve.engine.async_llm import RequestStream
from splitserve.engine.output_processor import RequestOutput

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class SSEBody:
    """A streamed body that aborts its requests however it ends (done, error, cancel, dropped).

    An async generator that Starlette never starts (the client left first) never runs its
    `finally`; this wrapper's `close` also runs when the object is dropped.
    """

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self._chunks = chunks
        self._on_close: Callable[[], None] | None = on_close

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def __del__(self) -> None:
        self.close()


class SSEResponse(StreamingResponse):
    """`text/event-stream` whose body is closed (requests aborted) however the send ends:
    finished, cancelled on disconnect, or failed writing to a closed socket."""

    def __init__(self, body: SSEBody) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._body = body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._body.close()


async def collect(stream: RequestStream) -> RequestOutput:
    """Wait for a request's last update."""
    while True:
        out = await stream.get()
        if out.finished:
            return out


async def iterate_streams(
    streams: list[RequestStream], firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, update) of several requests as they come, starting with `firsts`.

    A request that fails mid-way (e.g. its KV load failed under policy `fail`) raises.
    """
    for i, out in enumerate(firsts):
        yield i, out
    if len(streams) == 1:  # the common case: no tasks
        out = firsts[0]
        while not out.finished:
            out = await streams[0].get()
            if out.error is not None:
                raise RuntimeError(f"request failed: {out.error}")
            yield 0, out
        return
    pending = {
        asyncio.ensure_future(s.get()): i for i, s in enumerate(streams) if not firsts[i].finished
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if out.error is not None:
                    raise RuntimeError(f"request failed: {out.error}")
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].get())] = i
    finally:
        for task in pending:
            task.cancel()


async def with_errors(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Chunks, then `[DONE]`; a failure after the headers went out becomes an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except (RuntimeError, ValueError) as err:  # engine died, request failed mid-way
        yield sse(
            {
                "error": {
                    "message": str(err),
                    "type": "server_error",
                    "param": None,
                    "code": "stream_failed",
                }
            }
        )
    yield DONE
