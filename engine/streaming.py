"""Streaming plumbing of the OpenAI server: SSE bodies that always abort, and stream merging.

However a streamed response ends before its last update went out (client disconnect, a failed
write to a closed socket, a request that failed, or a response that is never sent), its engine
requests are abandoned exactly once: aborted, or their KV held for a consumer freed, so no block
outlives an answer nobody received. A request that fails after the headers went out becomes an SSE error
event followed by `[DONE]`, as OpenAI-compatible clients expect.

Per token, one update of every running request goes from the output loop to its handler and out
as one write to the socket, so the path is kept short: the body renders each update itself (no
generator per stage), and the last update's events, the usage chunk and `[DONE]` leave in the
same write that ends the HTTP body. The bytes on the wire are the same events, in fewer chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

from splitserve.engine.output_processor import RequestOutput
from splitserve.engine.request_stream import RequestStream

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_event(err: BaseException) -> bytes:
    """The event a failure after the headers becomes (engine died, request failed mid-way)."""
    error = {"message": str(err), "type": "server_error", "param": None, "code": "stream_failed"}
    return sse({"error": error})


class SSEBody:
    """The events of a streamed answer, rendered update by update; `on_abandon` runs once if it
    ends before every request's last update was rendered (error, cancel, dropped).

    `firsts` are the requests' first updates (already taken: they decided the status line).
    `render(index, update)` gives one update's events, `render_end()` those after the last update
    of every prompt (the usage chunk); `[DONE]` closes the body. One prompt (the common case) is
    read straight from its stream; several are merged by `iterate_streams`. An async generator
    that Starlette never starts (the client left first) never runs its `finally`; this object's
    `close` also runs when it is dropped.
    """

    def __init__(
        self,
        streams: list[RequestStream],
        firsts: list[RequestOutput],
        render: Callable[[int, RequestOutput], bytes],
        render_end: Callable[[], bytes],
        on_abandon: Callable[[], None],
    ) -> None:
        single = len(streams) == 1
        self._stream = streams[0] if single else None
        self._first: RequestOutput | None = firsts[0] if single else None
        self._updates = None if single else iterate_streams(streams, firsts)
        self._num_unfinished = len(streams)
        self._render, self._render_end = render, render_end
        self._on_abandon: Callable[[], None] | None = on_abandon
        self._done = False  # nothing more to send
        self._complete = False  # every request's last update rendered

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            if self._updates is not None:
                await self._updates.aclose()
            self.close()
            raise StopAsyncIteration
        try:
            i, out = await self._next_update()
            data = self._render(i, out)
            if out.finished:
                self._num_unfinished -= 1
                if self._num_unfinished == 0:
                    self._done = self._complete = True
                    return data + self._render_end() + DONE
            return data
        except (RuntimeError, ValueError) as err:  # engine died, request failed mid-way
            self._done = True
            return error_event(err) + DONE
        except StopAsyncIteration:  # the updates ended before every prompt finished
            self._done = True
            return DONE
        except BaseException:
            self.close()
            raise

    async def _next_update(self) -> tuple[int, RequestOutput]:
        if self._updates is not None:
            return await self._updates.__anext__()
        if self._first is not None:
            out, self._first = self._first, None
            return 0, out
        assert self._stream is not None
        out = await self._stream.get()
        if out.error is not None:
            raise RuntimeError(f"request failed: {out.error}")
        return 0, out

    def close(self) -> None:
        if self._on_abandon is not None:
            on_abandon, self._on_abandon = self._on_abandon, None
            if not self._complete:
                on_abandon()

    def __del__(self) -> None:
        self.close()


class SSEResponse(StreamingResponse):
    """`text/event-stream` whose body is closed however the send ends (its requests abandoned
    unless it finished): finished, cancelled on disconnect, or failed writing to a closed
    socket."""

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

    async def stream_response(self, send: Any) -> None:
        """Starlette's, except that the events ending in `[DONE]` also end the HTTP body: one
        write instead of two at the end of every stream."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        more = True
        async for data in self._body:
            more = not data.endswith(DONE)
            await send({"type": "http.response.body", "body": data, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def collect(stream: RequestStream) -> RequestOutput:
    """Wait for a request's last update."""
    while True:
        out = await stream.get()
        if out.finished:
            return out


async def iterate_streams(
    streams: list[RequestStream], firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, update) of several requests as they come, starting with `firsts` (one task
    per request waiting; a single request is read without: SSEBody).

    A request that fails mid-way (e.g. its KV load failed under policy `fail`) raises.
    """
    for i, out in enumerate(firsts):
        yield i, out
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
