"""RequestStream: the updates of one request, from the output loop to the handler that serves it.

The output loop puts one update per engine step; the handler takes what has arrived, merged, so a
handler slower than the engine does less work per token instead of falling behind. A stream wakes
its handler through a bare future rather than an asyncio.Event: one per token of every running
request, the Event's waiter list and loop checks were a visible share of the front end's time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from splitserve.engine.output_processor import RequestOutput


class RequestStream:
    """Updates of one request, produced by the output loop, consumed by one handler."""

    __slots__ = (
        "request_id",
        "prompt_len",
        "pending",
        "waiter",
        "error",
        "arrival",
        "last_token_time",
        "finished",
    )

    def __init__(self, request_id: str, prompt_len: int) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.pending: list[RequestOutput] = []
        self.waiter: asyncio.Future[None] | None = None
        """The handler's wake-up while it waits in `get` (set by `get`, resolved by `_wake`)."""
        self.error: BaseException | None = None
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        """Monotonic time of the last token update (set by the output loop, for metrics)."""
        self.finished = False
        """The request ended in the core or was aborted (set by AsyncLLM)."""

    def put(self, output: RequestOutput) -> None:
        self.pending.append(output)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # a cancelled handler left it behind
                waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The next update, merged with any others that arrived meanwhile."""
        while not self.pending:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        outputs, self.pending = self.pending, []
        return merge_outputs(outputs)


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Fold consecutive updates of one request: deltas concatenated, the rest from the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(
        last,
        new_text="".join(o.new_text for o in outputs),
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
    )
