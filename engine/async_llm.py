"""AsyncLLM: the front-end client of an engine-core process.

The front end tokenizes, sends tokens to the core, and turns the core's token batches back into
text (OutputProcessor: incremental detokenization and stop strings). Each request gets its own
async stream. One task reads the core's output socket; per message (one per engine step) it
detokenizes every request's new tokens and wakes the waiting streams (RequestStream, which hands
a slow consumer several updates merged).

Cancelling the consumer of a stream (client disconnect) aborts the request in the core, which
frees its KV blocks. A producer request that already finished holds its blocks for a consumer
that only its answer would have told: `abandon` frees those at once instead of at the lease's end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.core_client import CoreClient, EngineDeadError
from splitserve.engine.core_proc import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutput,
    CoreReady,
    EngineCoreOutputs,
    RequestRejected,
    UtilityRequest,
    UtilityResult,
)
from splitserve.engine.held_kv import HeldKV
from splitserve.engine.metrics import ServerMetrics
from splitserve.engine.output_processor import OutputProcessor, RequestOutput
from splitserve.engine.request import EngineCoreRequest, SamplingParams
from splitserve.engine.request_stream import RequestStream
from splitserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class RequestRejectedError(ValueError):
    """The core refused a request; `code` is "invalid_request" or "queue_full"."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


class AsyncLLM:
    """Start with `await AsyncLLM.start(config)`; stop with `await llm.shutdown()`."""

    def __init__(
        self, config: EngineConfig, metrics: ServerMetrics | None = None, log_level: str = "INFO"
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.log_level = log_level
        self.tokenizer = Tokenizer(config.model.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.streams: dict[str, RequestStream] = {}
        self.info: CoreReady | None = None
        self.dead_reason: str | None = None
        self._utility_calls: dict[int, asyncio.Future] = {}
        self.held_kv = HeldKV()
        self._next_call_id = 0
        self.core = CoreClient(config, log_level)
        self._output_task: asyncio.Task | None = None

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        metrics: ServerMetrics | None = None,
        log_level: str = "INFO",
        timeout_s: float = 600.0,
    ) -> AsyncLLM:
        """Spawn the core and wait until its model is loaded (or raise why it failed)."""
        llm = cls(config, metrics, log_level)
        try:
            await llm._start_process(timeout_s)
        except BaseException:
            await llm.shutdown(timeout_s=0.2)  # still loading: it cannot read a Shutdown
            raise
        return llm

    async def _start_process(self, timeout_s: float) -> None:
        self.info = await self.core.start(timeout_s)
        self._output_task = asyncio.create_task(self._output_loop(), name="core-output-loop")

    # ------------------------------------------------------------------------------ properties
    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.info is not None
        return self.info.vocab_size

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def core_pid(self) -> int | None:
        return self.core.pid

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        num_prior_output_tokens: int = 0,
    ) -> RequestStream:
        """Queue a request in the core; raise ValueError for a duplicate id.

        The last `num_prior_output_tokens` of `prompt_token_ids` are output generated elsewhere
        (EngineCoreRequest says how the core treats them)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = RequestStream(request_id, len(prompt_token_ids) - num_prior_output_tokens)
        self.streams[request_id] = stream
        self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, params, num_prior_output_tokens
        )
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=time.time(),
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            num_prior_output_tokens=num_prior_output_tokens,
        )
        self.core.send(AddRequest(req))
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Updates of one request as they are sampled; the last has `finished` set.

        Raises RequestRejectedError before the first update if the core refuses the request.
        Closing or cancelling the iterator early aborts the request in the core.
        """
        stream = self.add_request(
            request_id, prompt, prompt_token_ids, params, priority, kv_transfer_params
        )
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        self.output_processor.abort(request_id)
        self.held_kv.unwanted(request_id)  # the core may have finished it already
        if self.dead_reason is None:
            self.core.send(AbortRequests([request_id]))
        logger.debug("%s: aborted", request_id)

    def abandon(self, stream: RequestStream) -> None:
        """The handler gives up on a request without delivering its answer (client gone, an
        error): abort it if it still runs; if it finished holding KV for a consumer, nobody will
        pull it, so the producer frees the blocks now instead of at the lease's end."""
        if stream.finished:
            self.held_kv.unwanted(stream.request_id)
        else:
            self.abort(stream.request_id)

    # ------------------------------------------------------------------------------ utilities
    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The core's scheduler and KV-cache counters (a round trip to the core)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._next_call_id += 1
        call_id = self._next_call_id
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self.core.send(UtilityRequest(call_id, "stats"))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_calls.pop(call_id, None)

    # ------------------------------------------------------------------------------ output loop
    async def _output_loop(self) -> None:
        try:
            while self.dead_reason is None:
                for msg in await self.core.recv_batch():
                    self._handle(msg)
        except EngineDeadError as err:
            self._mark_dead(str(err))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a front-end bug must not leave clients hanging forever
            logger.exception("output loop failed")
            self._mark_dead(f"front-end output loop failed: {err}")

    def _handle(self, msg: CoreOutput) -> None:
        if isinstance(msg, EngineCoreOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, RequestRejected):
            stream = self.streams.pop(msg.request_id, None)
            self.output_processor.abort(msg.request_id)
            if stream is not None:
                stream.finished = True
                stream.fail(RequestRejectedError(msg.message, msg.code))
        elif isinstance(msg, UtilityResult):
            future = self._utility_calls.get(msg.call_id)
            if future is not None and not future.done():
                if msg.error is not None:
                    future.set_exception(RuntimeError(msg.error))
                else:
                    future.set_result(msg.result)
        elif isinstance(msg, CoreFailed):
            self._mark_dead(msg.message)

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        for o in msg.outputs:
            if o.kv_transfer_params is not None and o.finish_reason is not None:
                self.held_kv.finished(o.request_id, o.kv_transfer_params)
        outputs, to_abort = self.output_processor.process_outputs(msg.outputs)
        if to_abort:  # a stop string ended these: the core still thinks they run
            self.core.send(AbortRequests(to_abort))
        now = time.monotonic()
        metrics = self.metrics
        streams = self.streams
        num_new = 0
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                num_new += len(out.new_token_ids)
                if metrics is not None:
                    metrics.observe_tokens(stream, now)
                stream.last_token_time = now
            if out.finished:
                stream.finished = True
                del streams[out.request_id]
                if metrics is not None:
                    metrics.observe_finished(stream, now, out)
            stream.put(out)
        if metrics is not None:
            metrics.observe_step(num_new)

    def _mark_dead(self, reason: str) -> None:
        logger.error("engine core is dead: %s", reason)
        self.dead_reason = reason
        error = EngineDeadError(reason)
        for stream in self.streams.values():
            stream.finished = True
            stream.fail(error)
        self.streams.clear()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)

    # ------------------------------------------------------------------------------ shutdown
    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the output loop and the core; in-flight requests fail with EngineDeadError."""
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        await self.core.shutdown(timeout_s)
        if self.dead_reason is None:
            self.dead_reason = "engine is shut down"
        for stream in self.streams.values():
            stream.fail(EngineDeadError(self.dead_reason))
        self.streams.clear()
