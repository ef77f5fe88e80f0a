"""The per-instance OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming or not),
`GET /v1/models`, `GET /health`, `GET /metrics`. The engine runs in its own process (AsyncLLM
over ZMQ); this process parses, tokenizes, detokenizes and writes HTTP.

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with a status that
says whose fault it is: 400 bad JSON, bad field (named) or too-long prompt; 404 unknown model;
413 body over `max_body_bytes`; 503 waiting queue full or engine dead. Bad input never reaches a
500 and never hurts the server. A client that disconnects, mid-stream or while waiting for a
non-streamed answer, has its requests aborted in the core, which frees their KV blocks.

A streamed response's headers go out with its first token: the core's refusal (too long, queue
full) arrives before any token, so it can still be a proper error status instead of an SSE event.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestRejectedError
from splitserve.engine.config import EngineConfig
from splitserve.engine.metrics import CONTENT_TYPE, ServerMetrics
from splitserve.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    KVReleaseRequest,
    ModelCard,
    ModelList,
)
from splitserve.engine.serving import APIError, OpenAIServing
from splitserve.kv_connector.side_channel import release_remote_kv

logger = logging.getLogger(__name__)


class ServerConfig(BaseModel):
    """The `server:` section of an instance config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    """Bind address; loopback by default (put the router in front for public traffic)."""
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    """Larger request bodies are refused with 413."""
    max_waiting: int | None = Field(default=None, gt=0)
    """Bound of the engine's waiting queue (503 past it); overrides engine.scheduler.max_waiting."""
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    """Reported by /health; the prefill/decode entry points set it."""
    access_log: bool = False
    """uvicorn's per-request access log line (off: it costs throughput)."""


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    type_: str = "invalid_request_error",
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def validation_error(err: ValidationError | RequestValidationError) -> APIError:
    """400 naming the fields: `max_tokens: Input should be greater than or equal to 1`."""
    problems, first = [], None
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        first = first or loc or None
        problems.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    message = "; ".join(p.replace("Value error, ", "") for p in problems)
    return APIError(400, message or "invalid request", param=first, code="invalid_value")


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length up front or by counting chunked ones."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._reject(scope, receive, send)
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        # Only `receive` is wrapped (a wrapped `send` would cost a call per streamed chunk): the
        # routes read the whole body before they answer, so nothing was sent when this raises.
        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        response = error_response(
            413,
            f"request body larger than {self.max_body_bytes} bytes (server.max_body_bytes)",
            code="request_too_large",
        )
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise APIError(400, f"invalid JSON body: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response | None:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    logger.debug("client disconnected before the response")
    return None


def build_app(
    engine: AsyncLLM,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    metrics: ServerMetrics,
) -> FastAPI:
    model_name = engine_config.model.name
    serving = OpenAIServing(engine, model_name)
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=server_config.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.code, err.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        e = validation_error(err)
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), code=str(err.status_code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(
            500,
            f"internal error: {type(err).__name__}: {err}",
            type_="internal_error",
            code="internal_error",
        )

    async def handle(
        request: Request, model: type[BaseModel], run: Callable[[Any, str], Awaitable[Response]]
    ) -> Response:
        body = await parse_body(request, model)
        if body.model is not None and body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist (served: {model_name!r})",
                param="model",
                code="model_not_found",
            )
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            response = await until_disconnect(request, run(body, base_id))
        except RequestRejectedError as err:
            if err.code == "queue_full":
                raise APIError(503, str(err), code=err.code, type_="server_busy") from None
            raise APIError(400, str(err), param="prompt", code=err.code) from None
        except EngineDeadError as err:
            raise APIError(
                503, f"engine unavailable: {err}", code="engine_dead", type_="service_unavailable"
            ) from None
        if response is None:
            return Response(status_code=499)
        response.headers["X-Request-Id"] = base_id
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest, serving.chat_completions)

    @app.post("/v1/kv/release")
    async def release_kv(request: Request) -> JSONResponse:
        """Free the blocks a finished request holds for a consumer (the router calls this when
        generation stopped at the first token, so no decode instance will pull them). Connectors
        without holds (redis frees once its write lands) answer `released: false`."""
        body = await parse_body(request, KVReleaseRequest)
        # Through the connector's side channel, as a consumer's "done" would come: the
        # connector owns the hold (it may be serving or saving the blocks right now).
        held = await asyncio.to_thread(release_remote_kv, body.kv_transfer_params)
        return JSONResponse({"released": held})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(
            id=model_name, root=engine_config.model.model, max_model_len=engine.max_model_len
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {"status": "ok", "role": server_config.role, "model": model_name}
        try:
            stats = await engine.stats()
        except (EngineDeadError, RuntimeError, asyncio.TimeoutError) as err:
            body.update(status="error", error=str(err) or type(err).__name__)
            return JSONResponse(body, status_code=503)
        body.update(
            {
                k: stats[k]
                for k in (
                    "running",
                    "waiting",
                    "kv_blocks_free",
                    "kv_blocks_total",
                    "kv_usage",
                    "engine_id",
                )
            }
        )
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        try:
            metrics.update_engine_stats(await engine.stats())
        except (EngineDeadError, RuntimeError, asyncio.TimeoutError):
            pass  # still serve the front end's own metrics
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def serve(
    engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info"
) -> None:
    """Start the engine core, then serve HTTP until SIGTERM/SIGINT; always stop the core.

    A signal during startup (loading the model can take minutes) cancels the startup, which
    stops the core; asyncio.CancelledError then leaves this function.
    """
    metrics = ServerMetrics(engine_config.model.name)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, task.cancel)
    try:
        engine = await AsyncLLM.start(engine_config, metrics, log_level.upper())
    finally:
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
    # uvicorn re-raises a captured signal once it is done; make that re-raise harmless so the
    # finally below (stopping the core) runs instead of the default "terminate now".
    for sig in _SIGNALS:
        signal.signal(sig, _log_signal)
    try:
        app = build_app(engine, engine_config, server_config, metrics)
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=log_level.lower(),
            access_log=server_config.access_log,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        watchdog = asyncio.create_task(_exit_when_dead(engine, server))
        logger.info(
            "serving %s (%s) on http://%s:%d",
            engine_config.model.name,
            server_config.role,
            server_config.host,
            server_config.port,
        )
        await server.serve()
        watchdog.cancel()
        if engine.is_dead:  # not a requested stop: let the supervisor see a failure
            raise EngineDeadError(f"engine core died: {engine.dead_reason}")
    finally:
        await engine.shutdown()
        logger.info("shut down")


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _log_signal(signum: int, frame: Any) -> None:
    logger.info("received %s", signal.Signals(signum).name)


async def _exit_when_dead(engine: AsyncLLM, server: uvicorn.Server) -> None:
    """An instance whose core died cannot serve: stop so the supervisor restarts it."""
    while not engine.is_dead:
        await asyncio.sleep(1.0)
    if not server.should_exit:
        logger.error("engine core died (%s): stopping the server", engine.dead_reason)
        server.should_exit = True
